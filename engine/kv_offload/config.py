"""The offload tiers' settings (no torch here: the CLI reads them before anything heavy loads)."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class OffloadConfig:
    host_gib: float = 0.0
    disk_dir: str = ""
    disk_gib: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.host_gib > 0 or bool(self.disk_dir)

    def validate(self) -> None:
        if self.host_gib < 0:
            raise ValueError(f"kv_offload_host_gib must be >= 0, got {self.host_gib}")
        if self.disk_gib < 0:
            raise ValueError(f"kv_offload_disk_gib must be >= 0, got {self.disk_gib}")
        if self.disk_dir and self.disk_gib <= 0:
            raise ValueError("kv_offload_disk_dir needs kv_offload_disk_gib > 0 (how much of the disk it may use)")
        if self.disk_gib > 0 and not self.disk_dir:
            raise ValueError("kv_offload_disk_gib needs kv_offload_disk_dir (where the blocks go)")
