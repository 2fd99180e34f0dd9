"""Where the API process may fetch a request's images from (vLLM's --allowed-local-media-path and
--allowed-media-domains), and whether it takes images or prompts as embeddings (--enable-mm-embeds,
--enable-prompt-embeds). Standard library only:
the API processes' config (cluster/frontend/api_process.py) carries one to each process before it imports anything
else.

By default an image URL is a ``data:`` URL or an http(s) URL of any host this process reaches (a deployment that
reaches internal services should set the allowlist); ``file:`` URLs are read only under the directory named.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MediaPolicy:
    # file: URLs may name images at or under this directory (resolved: a symlink out of it is refused); None: file:
    # URLs are refused.
    allowed_local_media_path: Path | None = None
    # http(s) URLs (each redirect too) may name these hosts only, matched whole and case-blind; (): any host.
    allowed_media_domains: tuple[str, ...] = ()
    # image_embeds parts (vLLM's --enable-mm-embeds): an image's embeddings instead of the image; off, a 400.
    enable_mm_embeds: bool = False
    # prompt_embeds on completions, input_embeds on /generate (vLLM's --enable-prompt-embeds, an engine flag the
    # workers read too): a prompt given as embeddings; off, a 400.
    enable_prompt_embeds: bool = False

    @classmethod
    def from_flags(cls, local_media_path: str | None, media_domains: list[str] | tuple[str, ...] | None,
                   enable_mm_embeds: bool = False, enable_prompt_embeds: bool = False) -> MediaPolicy:
        """The policy of the serve flags; a ValueError names the flag and what is wrong."""
        root = None
        if local_media_path:
            root = Path(local_media_path).expanduser().resolve()
            if not root.is_dir():
                raise ValueError(f"--allowed-local-media-path: {local_media_path!r} is not a directory")
        domains = []
        for domain in media_domains or ():
            host = domain.strip().lower()
            if not host or "/" in host or ":" in host:
                raise ValueError(f"--allowed-media-domains: {domain!r} is not a host name (e.g. upload.wikimedia.org)")
            domains.append(host)
        return cls(root, tuple(domains), bool(enable_mm_embeds), bool(enable_prompt_embeds))

    def allows_host(self, host: str | None) -> bool:
        return not self.allowed_media_domains or (host or "").lower() in self.allowed_media_domains
