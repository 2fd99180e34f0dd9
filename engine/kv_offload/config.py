"""The offload tiers' settings (no torch here: the CLI reads them before anything heavy loads)."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class OffloadConfig:
    host_gib: float = 0.0
    disk_dir: str = ""
    disk_gib: float = 0.0
    # A tier every worker shares (shared_tier.py): a folder they all see, its size for all of them together.
    shared_dir: str = ""
    shared_gib: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.host_gib > 0 or bool(self.disk_dir) or bool(self.shared_dir)

    def validate(self) -> None:
        if self.host_gib < 0:
            raise ValueError(f"kv_offload_host_gib must be >= 0, got {self.host_gib}")
        if self.disk_gib < 0:
            raise ValueError(f"kv_offload_disk_gib must be >= 0, got {self.disk_gib}")
        if self.disk_dir and self.disk_gib <= 0:
            raise ValueError("kv_offload_disk_dir needs kv_offload_disk_gib > 0 (how much of the disk it may use)")
        if self.disk_gib > 0 and not self.disk_dir:
            raise ValueError("kv_offload_disk_gib needs kv_offload_disk_dir (where the blocks go)")
        if self.shared_gib < 0:
            raise ValueError(f"kv_offload_shared_gib must be >= 0, got {self.shared_gib}")
        if self.shared_dir and self.shared_gib <= 0:
            raise ValueError("kv_offload_shared_dir needs kv_offload_shared_gib > 0 (how much of it the workers may "
                             "use together)")
        if self.shared_gib > 0 and not self.shared_dir:
            raise ValueError("kv_offload_shared_gib needs kv_offload_shared_dir (the folder every worker sees)")
