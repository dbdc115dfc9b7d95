"""EXPERIMENT, not the service: test the proposed gateway fix without editing the gateway.

The gateway opens one internal WebSocket per stream through one
``aiohttp.ClientSession()`` whose default ``TCPConnector`` allows 100
connections; the 101st stream waits for a connection, times out after
``worker_lost_timeout_s`` and is refused as ``overloaded``. The proposed fix is
``aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))`` in
``gateway/app.py``. Put this directory on PYTHONPATH and every process (the
gateway included) gets that connector by default:

    PYTHONPATH=bench/experiments/gateway_connector_unlimited \
        python -m bench run --scenarios s4,s5 --out bench/results/experiment-connector \
        --markdown bench/results/experiment-connector/BENCHMARKS.md
"""

import aiohttp

_original_init = aiohttp.ClientSession.__init__


def _init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    if "connector" not in kwargs:
        kwargs["connector"] = aiohttp.TCPConnector(limit=0)
    _original_init(self, *args, **kwargs)


aiohttp.ClientSession.__init__ = _init  # type: ignore[method-assign]
