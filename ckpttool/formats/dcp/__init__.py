"""DCP (``torch.distributed.checkpoint``) directories: the registered format.

``.metadata`` plus ``__<rank>_<i>.distcp`` files (metadata.py); read by range (source.py), written
for any layout (sink.py; one record writer, records.py, and one ``.metadata`` builder,
metadata_pickle.py, which the training client's step writer shares), checked by ``verify``
(integrity.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..._lazy import lazy_names
from ...errors import NotACheckpointError
from ...report import Report
from ...storage import Location
from ..base import Format, Probe, Progress, SinkOptions
from . import integrity
from .metadata import METADATA_FILE, data_file_name, read_metadata
from .source import DcpSource
from .transforms import check_compress

if TYPE_CHECKING:
    from .sink import DcpSink

#: the writing module imports torch: imported on first use, so reading a checkpoint (inspect,
#: verify) does not import torch
__getattr__ = lazy_names(__name__, {"DcpSink": "sink"}, globals())


class DcpFormat(Format):
    name = "dcp"
    checksums = True  # torch's CRC-32 of every record, and ckpttool's manifest
    splits_integrity = True
    sink_options = frozenset({"layout", "compress"})
    ranked = True

    def sniff(self, probe: Probe) -> bool:
        return probe.is_dir and METADATA_FILE in probe.names

    def diagnose(self, probe: Probe) -> NotACheckpointError | None:
        if probe.is_dir and any(n.endswith(".distcp") for n in probe.names):
            return NotACheckpointError("DCP directory without .metadata (an interrupted save?)", where=probe.loc.url,
                                       hint="use a complete checkpoint")
        return None

    def open_source(self, loc: Location, verify: bool = True, reading: Any = None) -> DcpSource:
        return DcpSource(loc, verify=verify, rank=reading.rank if reading is not None else None)

    def make_sink(self, loc: Location, options: SinkOptions) -> DcpSink:
        from .sink import DcpSink

        return DcpSink(loc, layout=options.layout, compress=options.compress)

    def check_integrity(self, source: DcpSource, report: Report, only: str | None, progress: Progress | None,
                        share: tuple[int, int] | None = None) -> list[tuple[int, Report]] | None:
        return integrity.check_integrity(source, report, only, progress, share)


FORMAT = DcpFormat()

# The public API of the format
__all__ = ["FORMAT", "METADATA_FILE", "DcpSink", "DcpSource", "check_compress", "data_file_name", "read_metadata"]
