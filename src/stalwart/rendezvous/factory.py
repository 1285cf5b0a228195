"""The rendezvous a launcher's settings call for."""

from __future__ import annotations

from stalwart.config import LaunchConfig
from stalwart.rendezvous.c10d import C10dRendezvous, StoreEndpoint


def from_config(cfg: LaunchConfig) -> C10dRendezvous:
    """The c10d store the nodes meet at (a private loopback one for a single node)."""
    join_timeout = cfg.join_timeout
    if cfg.nnodes == 1:
        return C10dRendezvous(
            run_id=cfg.run_id,
            nnodes=1,
            endpoint=StoreEndpoint("127.0.0.1", 0),
            host_store=True,
            node_rank=0,
            master_addr=cfg.effective_master_addr,
            join_timeout=join_timeout,
        )
    if cfg.rdzv_backend == "static" or not cfg.rdzv_endpoint:
        endpoint = StoreEndpoint(cfg.effective_master_addr, cfg.master_port)
        if cfg.rdzv_endpoint:
            endpoint = StoreEndpoint.parse(cfg.rdzv_endpoint, cfg.master_port)
        is_host = cfg.node_rank == 0
    else:
        endpoint = StoreEndpoint.parse(cfg.rdzv_endpoint)
        explicit = cfg.rdzv_conf.get("is_host")
        is_host = (
            explicit.lower() in ("1", "true", "yes") if explicit is not None else cfg.node_rank == 0
        )
    return C10dRendezvous(
        run_id=cfg.run_id,
        nnodes=cfg.nnodes,
        endpoint=endpoint,
        host_store=is_host,
        node_rank=cfg.node_rank,
        master_addr=endpoint.host,
        join_timeout=join_timeout,
    )
