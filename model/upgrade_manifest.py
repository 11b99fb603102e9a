"""`python -m fermijit.model.upgrade_manifest DIR`: rewrite a format-1 `fermijit.json` (no
checksums) as the current format, recording the checksums of the weights as they are now; the
weights file is not touched. Run once on fermijit/default_model; for other models,
converting again is the safer way (it re-reads the source)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from fermijit.model.config import build
from fermijit.model.convert import write_manifest
from fermijit.model.files import read_json
from fermijit.model.manifest import MANIFEST, Quant, Source


@dataclasses.dataclass(frozen=True)
class _EntryV1:
    shape: tuple[int, ...]
    quant: Quant


@dataclasses.dataclass(frozen=True)
class _ManifestV1:
    format_version: int
    converter: str
    source: Source
    weights: str
    tensors: dict[str, _EntryV1]
    reap: dict[str, object] | None = None


def upgrade(directory: Path) -> None:
    old = build(_ManifestV1, read_json(directory / MANIFEST), str(directory / MANIFEST))
    if old.format_version != 1:
        raise SystemExit(f"{directory / MANIFEST}: format version {old.format_version}, not 1")
    write_manifest(directory, {n: (e.shape, e.quant) for n, e in old.tensors.items()},
                   old.source, old.reap, old.weights)


if __name__ == "__main__":
    upgrade(Path(sys.argv[1]))
