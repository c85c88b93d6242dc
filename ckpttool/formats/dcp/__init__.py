"""DCP (``torch.distributed.checkpoint``) directories: the registered format.

``.metadata`` plus ``__<rank>_<i>.distcp`` files (metadata.py); read offline by range (source.py),
written offline for any layout (sink.py), checked by ``verify`` (integrity.py), and saved/loaded
online through torch's own reader and writer with our rules (online.py).
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
    from .load import load_into
    from .online import dcp_writer, hash_records, metadata_row
    from .save import (HostShard, Written, commit_metadata, per_rank_buffer_keys, per_rank_keys, publish_failure, read_rank_indexes,
                       step_bytes, stores, supports, write_rank)
    from .sink import DcpSink

#: the names of the writing and loading modules (they import torch): imported on first use, so
#: reading a checkpoint offline (inspect, verify) does not import torch
_LAZY = {"load_into": "load", "dcp_writer": "online", "hash_records": "online", "metadata_row": "online",
         **{name: "save" for name in ("HostShard", "Written", "commit_metadata", "per_rank_buffer_keys", "per_rank_keys", "publish_failure",
                                     "read_rank_indexes", "step_bytes", "stores", "supports", "write_rank")},
         "DcpSink": "sink"}


__getattr__ = lazy_names(__name__, _LAZY, globals())


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

# The public API of the format: what the training API (checkpointer.py) uses, and all it uses.
__all__ = ["FORMAT", "METADATA_FILE", "DcpSink", "DcpSource", "HostShard", "check_compress", "commit_metadata", "data_file_name",
           "dcp_writer", "hash_records", "load_into", "metadata_row", "per_rank_buffer_keys", "per_rank_keys", "publish_failure", "read_metadata", "read_rank_indexes", "step_bytes",
           "stores", "supports", "write_rank", "Written"]
