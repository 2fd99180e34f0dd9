"""Several API server processes over one router (``pdcluster serve --api-servers N``), as vLLM's
``--api-server-count``: HTTP parsing, tokenization, detokenization and SSE encoding cost the serving
process tens of microseconds a streamed token, so one process caps a GPU's output; N processes share
the listening socket and each streams its own requests.

    supervisor.py     the main process: the router, the service below, the N processes; shutdown
    service.py        RouterService: the router behind a zmq socket, one stream of deltas per process
    remote_router.py  RemoteRouter: router_contract.Router over that socket, in an API process
    api_process.py    an API process's entry: the app over a RemoteRouter, uvicorn on the shared socket
    protocol.py       the typed records between them
"""
