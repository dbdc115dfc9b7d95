"""The load generator's WebSocket client: aiohttp's, behind the small interface
``bench.load`` and ``bench.peer_load`` use (``connect``, a callback per message as it
arrives, ``send_bytes``/``send_str``, ``closed_event``, ``close``).

aiohttp checks ``Sec-WebSocket-Accept`` and masks each frame with a fresh random key
(in C), as RFC 6455 asks of a client. The hand-written client this replaces
(frames parsed in an ``asyncio.Protocol``, the all-zero masking key, no accept check)
would have stayed only if a measurement showed the load needed it. It does not:
``python -m bench.client_cost --streams 100 --seconds 20`` (100 live streams at
real-time pace against ``bench.floor`` on loopback; the load process's CPU per
stream-second, start-up included; a shared 2-core VM, 2026-12-05, runs alternated)
gave 0.84, 0.77, 0.66, 0.77 ms for the hand-written client and 0.97, 0.92, 0.89 ms for
aiohttp's; less the start-up (``--streams 1 --seconds 1``: 0.11 s and 0.21 s of CPU),
medians of 0.72 and 0.81 ms, about 0.1 ms per stream-second more (0.05 core at 500
streams). The load runs in processes of its own and the bench measures each server's
own CPU, so that difference does not enter a server's figure.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import aiohttp
from aiohttp import WSMsgType

OP_TEXT, OP_BINARY = 0x1, 0x2
#: ``on_message(opcode, payload)``: a text message's payload is its ``str``
OnMessage = Callable[[int, str | bytes], None]


class WebSocketError(Exception):
    """The handshake was refused or the peer broke the protocol."""


class StreamSocket:
    """One client connection; ``on_message`` gets each text/binary message."""

    def __init__(self, http: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse,
                 on_message: OnMessage) -> None:
        self._http = http
        self._ws = ws
        self.on_message = on_message
        self.close_code: int | None = None
        self.closed_event = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for msg in self._ws:  # pings answered and close echoed by aiohttp
                if msg.type is WSMsgType.TEXT:
                    self.on_message(OP_TEXT, msg.data)
                elif msg.type is WSMsgType.BINARY:
                    self.on_message(OP_BINARY, msg.data)
                elif msg.type is WSMsgType.ERROR:
                    break
        except (aiohttp.ClientError, OSError):
            pass
        finally:
            self.close_code = self._ws.close_code
            self.closed_event.set()

    async def send_bytes(self, data: bytes) -> None:
        await self._ws.send_bytes(data)

    async def send_str(self, text: str) -> None:
        await self._ws.send_str(text)

    @property
    def closed(self) -> bool:
        return self.closed_event.is_set() or self._ws.closed

    async def close(self, code: int = 1000) -> None:
        with contextlib.suppress(aiohttp.ClientError, OSError):
            await self._ws.close(code=code)
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self._http.close()


async def connect(url: str, on_message: OnMessage, timeout_s: float = 30.0) -> StreamSocket:
    """Open ``url``; ``WebSocketError`` if the server refuses the upgrade or answers it
    wrongly (status, ``Sec-WebSocket-Accept``)."""
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    try:
        async with asyncio.timeout(timeout_s):
            ws = await http.ws_connect(url, autoping=True, max_msg_size=1 << 22)
    except aiohttp.WSServerHandshakeError as exc:
        await http.close()
        raise WebSocketError(f"handshake refused: {exc}") from None
    except BaseException:
        await http.close()
        raise
    return StreamSocket(http, ws, on_message)
