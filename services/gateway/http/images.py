"""An `image_url` part's picture: a `data:` URL decoded, or (when allowed) an http(s) URL fetched.

Fetching is off unless the gateway runs with --http-image-urls: a server that fetches any URL
it is given lets its callers reach its own network. Either way the bytes are capped
(--http-image-url-max-mib) and a fetch has a time limit (--http-image-url-timeout-s). Every
failure is a 400 naming the part; the image decoder behind (the vision service) judges the
bytes themselves.
"""

from __future__ import annotations

import base64
import binascii
from urllib.parse import urlsplit

from services.gateway.config import HttpConfig
from services.gateway.http.errors import ParamError
from vlmesh.v1 import common_pb2 as pb


def decode_data_url(url: str, where: str, max_bytes: int) -> pb.Image:
    """A `data:image/...;base64,...` URL's image."""
    head, sep, data = url.partition(",")
    if not sep:
        raise ParamError(f"{where}: a data: URL needs a comma before its data", where)
    fields = head[len("data:") :].split(";")
    mime, params = fields[0].strip().lower(), [p.strip().lower() for p in fields[1:]]
    if "base64" not in params:
        raise ParamError(f"{where}: only base64 data: URLs are taken (data:image/png;base64,...)", where)
    if mime and not mime.startswith("image/"):
        raise ParamError(f"{where}: a data: URL of type {mime!r} is not an image", where)
    if len(data) * 3 // 4 > max_bytes:
        raise ParamError(f"{where}: the image is over the limit of {max_bytes} bytes", where)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ParamError(f"{where}: the data: URL is not valid base64", where) from None
    if not raw:
        raise ParamError(f"{where}: the data: URL holds no bytes", where)
    return pb.Image(data=raw, mime_type=mime)


class ImageFetcher:
    """Turns image URLs into images, under the gateway's HTTP config."""

    def __init__(self, cfg: HttpConfig) -> None:
        self.cfg = cfg
        self._client = None  # an httpx.AsyncClient, made on the first fetch

    async def image(self, url: str, where: str) -> pb.Image:
        scheme = urlsplit(url).scheme.lower() if ":" in url else ""
        if scheme == "data":
            return decode_data_url(url, where, self.cfg.max_image_bytes)
        if scheme not in ("http", "https"):
            raise ParamError(f"{where}: give a data: URL (base64) or an http(s) URL, not {url[:40]!r}", where)
        if not self.cfg.image_urls:
            raise ParamError(
                f"{where}: this server does not fetch image URLs; send the image as a data: URL "
                "(base64), or start the gateway with --http-image-urls",
                where,
            )
        return await self._fetch(url, where)

    async def _fetch(self, url: str, where: str) -> pb.Image:
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.cfg.image_url_timeout_s, follow_redirects=True)
        limit = self.cfg.max_image_bytes
        try:
            async with self._client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise ParamError(f"{where}: fetching the image gave HTTP {resp.status_code}", where)
                mime = resp.headers.get("content-type", "").split(";")[0].strip().lower()
                if mime and not mime.startswith("image/") and mime != "application/octet-stream":
                    raise ParamError(f"{where}: the URL serves {mime!r}, not an image", where)
                chunks, size = [], 0
                async for chunk in resp.aiter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise ParamError(f"{where}: the image is over the limit of {limit} bytes", where)
                    chunks.append(chunk)
        except httpx.TimeoutException:
            raise ParamError(
                f"{where}: the image could not be fetched within {self.cfg.image_url_timeout_s:g} s", where
            ) from None
        except httpx.HTTPError as err:
            raise ParamError(f"{where}: the image could not be fetched: {type(err).__name__}", where) from None
        image = pb.Image(data=b"".join(chunks), mime_type=mime if mime.startswith("image/") else "")
        if not image.data:
            raise ParamError(f"{where}: the URL served no bytes", where)
        return image

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
