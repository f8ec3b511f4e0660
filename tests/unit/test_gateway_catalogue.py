"""The gateway's catalogue reads on a miss, in process: calls for unknown models share spaced
reads (a flood of unknown names is not a flood of Redis reads), and a model announced since the
last read is still found."""

from __future__ import annotations

import asyncio
from typing import Any

from asyncinfer.broker.catalogue import CatalogueEntry
from asyncinfer.gateway.call_errors import GatewayError
from asyncinfer.gateway.service import Service


class _Catalogue:
    """A client whose catalogue reads are counted (each takes a little while, as Redis does)."""

    def __init__(self) -> None:
        self.models_known: dict[str, CatalogueEntry] = {"mlp": CatalogueEntry("mlp")}
        self.reads = 0

    def models(self, *, stale_ok: bool = False) -> dict[str, CatalogueEntry]:
        self.reads += 1
        return dict(self.models_known)

    def ping(self) -> None:
        return None

    async def aclose(self) -> None:
        return None


def test_a_flood_of_unknown_models_shares_spaced_catalogue_reads() -> None:
    stub = _Catalogue()

    async def main() -> tuple[list[Any], int, int]:
        service = Service(stub)  # type: ignore[arg-type]
        await service.start()
        reads_at_start = stub.reads
        # When 300 calls for unknown models arrive at once, in three waves
        outcomes: list[Any] = []
        for wave in range(3):
            outcomes += await asyncio.gather(*(service.entry(f"nosuch-{wave}-{i}") for i in range(100)),
                                             return_exceptions=True)
        flood_reads = stub.reads - reads_at_start
        # And a model is announced after the last read
        stub.models_known["late"] = CatalogueEntry("late")
        found = await service.entry("late")
        await service.close()
        return outcomes, flood_reads, found.name == "late"

    outcomes, flood_reads, found_late = asyncio.run(main())
    # Then every call was answered 404 naming its model, with a handful of reads, not 300
    assert all(isinstance(o, GatewayError) and o.status == 404 for o in outcomes)
    assert "nosuch-2-99" in str(outcomes[-1]) and "known: mlp" in str(outcomes[-1])
    assert 1 <= flood_reads <= 4, flood_reads
    # And the model announced since was found by the next miss's read
    assert found_late
