"""The writer process's settings are declared once: the checkpointer's config extends them."""

from __future__ import annotations

import dataclasses
import logging

from stalwart.checkpoint import CheckpointerConfig
from stalwart.checkpoint.process_args import WriterProcessConfig, _as_config


def test_checkpointer_config_extends_the_writer_config() -> None:
    shared = {f.name for f in dataclasses.fields(WriterProcessConfig)}
    assert shared <= {f.name for f in dataclasses.fields(CheckpointerConfig)}
    cfg = CheckpointerConfig(write_timeout_s=7.0, writer_nice=0, log_level=logging.DEBUG)
    # Handed to the writer process as it is: nothing is copied field by field.
    assert _as_config(cfg) is cfg
    assert (cfg.write_timeout_s, cfg.writer_nice, cfg.log_level) == (7.0, 0, logging.DEBUG)


def test_defaults_that_differ_are_declared_where_they_differ() -> None:
    assert CheckpointerConfig().init_timeout_s == 120.0
    assert WriterProcessConfig().init_timeout_s == 60.0
    assert CheckpointerConfig().copy_threads == 0  # 0: chosen from the cores
    assert WriterProcessConfig().copy_threads == 1
