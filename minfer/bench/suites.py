"""The suites apps/benchmark.py offers. Each suite module registers its `Suite` here, so a new weight
format or attention backend adds its suite in its own file and the app names none of them.

A run of the app calls, over the chosen suites in registration order, every `check` (before the GPU is
touched), then every `run`, every `report` and every distinct `plot` (suites that share a figure give
the same function, which draws once).
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..parallel import Sharding
from .timing import copy_bandwidth_gbs

# The modules that register suites, in the order --suite lists them (and "all" runs its members).
SUITE_MODULES = ("kernel_suite", "e2e_suite", "macko_suite", "sparse24_suite", "attention_suite", "ksmm_suite")


@dataclass
class SuiteRun:
    """What the suites of one run of the app share."""
    args: argparse.Namespace
    dtype: torch.dtype
    env: dict
    sharding: Sharding
    results: dict  # every registered suite's JSON sections, empty until that suite has run
    write_json: Callable[[], None]

    def copy_gbs(self) -> float:
        """The device copy rate (GB/s): the one a suite measured earlier in this run, else measured now."""
        if "copy_gbs" not in self.env:
            self.env["copy_gbs"] = round(copy_bandwidth_gbs(), 1)
        return self.env["copy_gbs"]

    def save(self, sections: dict) -> None:
        """Keep `sections` and rewrite the JSON, so a run cut short keeps what it measured."""
        self.results.update(sections)
        self.write_json()


@dataclass(frozen=True)
class Suite:
    name: str
    sections: dict[str, type]  # the JSON keys it fills, each with the type of its empty value
    run: Callable[[SuiteRun], dict]  # measures; returns its sections
    report: Callable[[SuiteRun], None]  # prints its tables from SuiteRun.results
    help: str = ""  # its line in --suite's help
    flags: tuple[str, ...] = ()  # the optional flags it takes (argparse dests), also through --suite all
    alone_flags: tuple[str, ...] = ()  # flags it takes only when chosen by name, not through --suite all
    e2e: bool = False  # runs a model: takes the model and prompt flags, checked before any suite runs
    in_all: bool = False  # one of --suite all
    check: Callable[[argparse.Namespace], object] | None = None  # refuses bad flag values (MinferError)
    plot: Callable[[SuiteRun, str], bool] | None = None  # draws to the path; False when it had nothing to draw


SUITES: dict[str, Suite] = {}


def register(suite: Suite) -> None:
    if suite.name in SUITES or suite.name == "all":
        raise ValueError(f"benchmark suite {suite.name!r} is registered twice or takes the name of --suite all")
    SUITES[suite.name] = suite


def registered() -> dict[str, Suite]:
    """Every suite by name, in --suite's order: SUITE_MODULES's, whichever module was imported first."""
    for name in SUITE_MODULES:
        importlib.import_module(f"{__package__}.{name}")

    def module_rank(suite: Suite) -> int:
        module = suite.run.__module__.rpartition(".")[2]
        return SUITE_MODULES.index(module) if module in SUITE_MODULES else len(SUITE_MODULES)

    return {suite.name: suite for suite in sorted(SUITES.values(), key=module_rank)}


def chosen(name: str) -> list[Suite]:
    """The suites `--suite name` runs."""
    suites = registered()
    return [suite for suite in suites.values() if suite.in_all] if name == "all" else [suites[name]]


def flag_suites(flag: str) -> tuple[str, ...]:
    """The --suite values a flag applies to."""
    suites = registered().values()
    names = [suite.name for suite in suites if flag in suite.flags or flag in suite.alone_flags]
    return tuple(names) + (("all",) if any(suite.in_all and flag in suite.flags for suite in suites) else ())
