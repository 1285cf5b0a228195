"""The launcher's side of the rendezvous seam: `LaunchConfig` -> the rendezvous it calls for.

* one node: a private loopback ``TCPStore`` (static membership of one);
* ``--rdzv-backend static`` (torchrun's default without an endpoint): fixed membership
  through node 0's store at ``--master-addr:--master-port``;
* ``c10d`` with an endpoint: elastic, on a ``TCPStore`` hosted by the launcher whose
  machine owns the endpoint's address (or ``is_host=1``);
* ``etcd``: elastic, every key in an etcd cluster.

The rendezvous package knows nothing of the launcher's settings: the translations
(`elastic_settings`, `store_request_timeout`) are pure functions of the config, and
`rendezvous_for` does the connecting.
"""

from __future__ import annotations

import time

from stalwart.base.sealed import Seal, derive_key
from stalwart.config import LaunchConfig, RendezvousConf
from stalwart.rendezvous.api import RendezvousError, StoreLost
from stalwart.rendezvous.close_rule import ElasticSettings
from stalwart.rendezvous.elastic import ElasticRendezvous
from stalwart.rendezvous.etcd import EtcdAccess, EtcdKV
from stalwart.rendezvous.gate import AdmissionGate
from stalwart.rendezvous.kv import (
    KV,
    STORE_LABEL,
    C10dKV,
    check_run_id,
    is_local_address,
    local_address_towards,
)
from stalwart.rendezvous.static import OP_TIMEOUT, StaticRendezvous, StoreEndpoint

# An elastic store call is bounded by the time a node takes to count as lost, at least this.
_MIN_ELASTIC_REQUEST = 2.0


def store_request_timeout(conf: RendezvousConf, elastic: bool) -> float:
    """How long one store request may take: torch's ``read_timeout`` where given; else a
    static store's fixed bound, or an elastic one's keep-alive loss time."""
    if conf.read_timeout is not None:
        return conf.read_timeout
    return max(conf.lost_after, _MIN_ELASTIC_REQUEST) if elastic else OP_TIMEOUT


def elastic_settings(cfg: LaunchConfig) -> ElasticSettings:
    conf = cfg.rdzv_conf
    return ElasticSettings(
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        max_restarts=cfg.max_restarts,
        join_timeout=conf.join_timeout,
        last_call_timeout=conf.last_call_timeout,
        close_timeout=conf.close_timeout,
        keep_alive_interval=conf.keep_alive_interval,
        keep_alive_max_attempt=conf.keep_alive_max_attempt,
    )


def store_seal(secret: bytes | None, run_id: str) -> Seal:
    """What seals the job's records in its rendezvous store: a key derived from the
    job's secret, or none (values in the clear, as torchrun's) without one."""
    key = derive_key(secret, STORE_LABEL, run_id) if secret is not None else None
    return Seal(key, STORE_LABEL)


def rendezvous_for(
    cfg: LaunchConfig, secret: bytes | None = None, gate: AdmissionGate | None = None
) -> StaticRendezvous | ElasticRendezvous:
    """The rendezvous *cfg* asks for, connected (or hosting its store); *secret*, the
    job's, seals the records that steer it; an elastic one asks *gate* who may join each
    round."""
    conf = cfg.rdzv_conf
    seal = store_seal(secret, cfg.run_id)
    if cfg.max_nodes == 1:
        return StaticRendezvous(
            run_id=cfg.run_id,
            nnodes=1,
            endpoint=StoreEndpoint("127.0.0.1", 0),
            host_store=True,
            node_rank=0,
            master_addr=cfg.effective_master_addr,
            join_timeout=conf.join_timeout,
            op_timeout=store_request_timeout(conf, elastic=False),
            seal=seal,
        )
    if cfg.rdzv_backend == "static" or not cfg.rdzv_endpoint:
        endpoint = StoreEndpoint(cfg.effective_master_addr, cfg.master_port)
        if cfg.store_endpoints:
            endpoint = StoreEndpoint(*cfg.store_endpoints[0])
        return StaticRendezvous(
            run_id=cfg.run_id,
            nnodes=cfg.nnodes,
            endpoint=endpoint,
            host_store=cfg.node_rank == 0,
            node_rank=cfg.node_rank,
            master_addr=endpoint.host,
            join_timeout=conf.join_timeout,
            op_timeout=store_request_timeout(conf, elastic=False),
            seal=seal,
        )
    return _elastic(cfg, seal, gate)


def _elastic(cfg: LaunchConfig, seal: Seal, gate: AdmissionGate | None) -> ElasticRendezvous:
    settings = elastic_settings(cfg)
    conf = cfg.rdzv_conf
    request_timeout = store_request_timeout(conf, elastic=True)
    kv: KV
    hosts_store = False
    if cfg.rdzv_backend == "etcd":
        endpoints: list[tuple[str, int]] = list(cfg.store_endpoints)
        wanted = cfg.etcd_access
        access = (
            EtcdAccess(wanted.tls_context(), wanted.username, wanted.password)
            if wanted is not None
            else None
        )
        etcd = EtcdKV(
            endpoints,
            cfg.run_id,
            lease_ttl=settings.lost_after,
            request_timeout=request_timeout,
            access=access,
        )
        _wait_for_etcd(etcd, conf.join_timeout)
        kv = etcd
        local = cfg.local_addr or local_address_towards(*endpoints[0])
    else:
        ep = StoreEndpoint(*cfg.store_endpoints[0])
        kv, hosts_store = _c10d_kv(ep, conf, request_timeout)
        local = cfg.local_addr or (
            ep.host if hosts_store else local_address_towards(ep.host, ep.port)
        )
        # is_host=0 everywhere means a process outside the job hosts the store: nobody
        # will publish the id, so the first node to arrive claims it.
        external = conf.is_host is False
        check_run_id(kv, cfg.run_id, hosts_store, conf.join_timeout, str(ep), external)
    return ElasticRendezvous(
        kv,
        settings,
        run_id=cfg.run_id,
        local_addr=local,
        rank_hint=cfg.node_rank,
        backend=cfg.rdzv_backend,
        hosts_store=hosts_store,
        seal=seal,
        gate=gate,
    )


def _c10d_kv(ep: StoreEndpoint, conf: RendezvousConf, op_timeout: float) -> tuple[C10dKV, bool]:
    def kv(host: bool) -> C10dKV:
        return C10dKV(
            ep.host,
            ep.port,
            is_host=host,
            connect_timeout=conf.join_timeout,
            op_timeout=op_timeout,
        )

    if conf.is_host is not None:
        return kv(conf.is_host), conf.is_host
    if is_local_address(ep.host):
        # Like torchrun: the launcher on the endpoint's machine hosts the store; when
        # several launchers share that machine, the first to bind the port does.
        try:
            return kv(True), True
        except RendezvousError as err:
            if "in use" not in str(err).lower():
                raise
    return kv(False), False


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
