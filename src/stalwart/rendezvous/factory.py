"""The rendezvous a launcher's settings call for.

* one node: a private loopback ``TCPStore`` (static);
* ``--rdzv-backend static`` (torchrun's default without an endpoint): fixed membership
  through node 0's store at ``--master-addr:--master-port``;
* ``c10d`` with an endpoint: elastic, on a ``TCPStore`` hosted by the launcher whose
  machine owns the endpoint's address (or ``is_host=1``);
* ``etcd``: elastic, every key in an etcd cluster.
"""

from __future__ import annotations

import time

from stalwart.config import ConfigError, LaunchConfig
from stalwart.rendezvous.api import RendezvousError, StoreLost
from stalwart.rendezvous.c10d import C10dRendezvous, StoreEndpoint
from stalwart.rendezvous.elastic import ElasticRendezvous, ElasticSettings
from stalwart.rendezvous.etcd import EtcdKV, access_from_conf, parse_endpoints
from stalwart.rendezvous.kv import (
    KV,
    C10dKV,
    check_run_id,
    is_local_address,
    local_address_towards,
)


def from_config(cfg: LaunchConfig) -> C10dRendezvous | ElasticRendezvous:
    join_timeout = cfg.join_timeout
    if cfg.max_nodes == 1:
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
        return C10dRendezvous(
            run_id=cfg.run_id,
            nnodes=cfg.nnodes,
            endpoint=endpoint,
            host_store=cfg.node_rank == 0,
            node_rank=cfg.node_rank,
            master_addr=endpoint.host,
            join_timeout=join_timeout,
        )
    return elastic_from_config(cfg)


def settings_from_config(cfg: LaunchConfig) -> ElasticSettings:
    return ElasticSettings(
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        max_restarts=cfg.max_restarts,
        join_timeout=cfg.join_timeout,
        last_call_timeout=cfg.rdzv_seconds("last_call_timeout"),
        close_timeout=cfg.rdzv_seconds("close_timeout"),
        keep_alive_interval=cfg.rdzv_seconds("keep_alive_interval"),
        keep_alive_max_attempt=int(cfg.rdzv_conf.get("keep_alive_max_attempt", "3")),
    )


def elastic_from_config(cfg: LaunchConfig) -> ElasticRendezvous:
    settings = settings_from_config(cfg)
    kv: KV
    hosts_store = False
    if cfg.rdzv_backend == "etcd":
        try:
            endpoints = parse_endpoints(cfg.rdzv_endpoint)
            access = access_from_conf(cfg.rdzv_conf, cfg.rdzv_endpoint)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        etcd = EtcdKV(
            endpoints,
            cfg.run_id,
            lease_ttl=settings.lost_after,
            request_timeout=max(2.0, settings.lost_after),
            access=access,
        )
        _wait_for_etcd(etcd, cfg.join_timeout)
        kv = etcd
        local = cfg.local_addr or local_address_towards(*endpoints[0])
    else:
        try:
            ep = StoreEndpoint.parse(cfg.rdzv_endpoint)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        kv, hosts_store = _c10d_kv(cfg, ep, settings)
        local = cfg.local_addr or (
            ep.host if hosts_store else local_address_towards(ep.host, ep.port)
        )
        # is_host=0 everywhere means a process outside the job hosts the store: nobody
        # will publish the id, so the first node to arrive claims it.
        external = cfg.rdzv_conf.get("is_host", "").lower() in ("0", "false", "no")
        check_run_id(kv, cfg.run_id, hosts_store, cfg.join_timeout, str(ep), external)
    return ElasticRendezvous(
        kv,
        settings,
        run_id=cfg.run_id,
        local_addr=local,
        rank_hint=cfg.node_rank,
        backend=cfg.rdzv_backend,
        hosts_store=hosts_store,
    )


def _c10d_kv(cfg: LaunchConfig, ep: StoreEndpoint, s: ElasticSettings) -> tuple[C10dKV, bool]:
    op_timeout = max(s.lost_after, 2.0)
    explicit = cfg.rdzv_conf.get("is_host")
    if explicit is not None:
        host = explicit.lower() in ("1", "true", "yes")
        kv = C10dKV(
            ep.host, ep.port, is_host=host, connect_timeout=cfg.join_timeout, op_timeout=op_timeout
        )
        return kv, host
    if is_local_address(ep.host):
        # Like torchrun: the launcher on the endpoint's machine hosts the store; when
        # several launchers share that machine, the first to bind the port does.
        try:
            return C10dKV(
                ep.host,
                ep.port,
                is_host=True,
                connect_timeout=cfg.join_timeout,
                op_timeout=op_timeout,
            ), True
        except RendezvousError as err:
            if "in use" not in str(err).lower():
                raise
    kv = C10dKV(
        ep.host, ep.port, is_host=False, connect_timeout=cfg.join_timeout, op_timeout=op_timeout
    )
    return kv, False


def _wait_for_etcd(etcd: EtcdKV, timeout: float) -> None:
    """etcd may still be starting: retry for a bounded time, then one clear error."""
    limit = min(timeout, 30.0)
    deadline = time.monotonic() + limit
    while True:
        try:
            etcd.ping(timeout=max(0.5, min(2.0, deadline - time.monotonic())))
            return
        except StoreLost as err:  # unreachable; a refusal (say, bad credentials) is final
            if time.monotonic() > deadline:
                raise RendezvousError(f"{err} (gave up after {limit:g}s)") from None
        time.sleep(0.2)
