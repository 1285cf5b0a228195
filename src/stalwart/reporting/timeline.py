"""A picture of a run: ranks x time across attempts, from its events.

``build(events)`` is pure and gives the segments and markers; ``to_html`` writes one
self-contained page (inline SVG and CSS: no script, no network; every value from a
record is escaped) and ``png_drawer`` draws the same with matplotlib (the ``report``
extra), imported only when asked for.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from stalwart.base.events import Event
from stalwart.base.records import printable
from stalwart.reporting.goodput import CATEGORIES, Breakdown, account, last_step_end

# Drawing order and colours shared by the page and the image.
COLOURS = {
    "startup": "#9ecae1",
    "running": "#31a354",
    "hang": "#fd8d3c",
    "detection": "#e6550d",
    "teardown": "#969696",
    "restart": "#dadaeb",
}


@dataclass(frozen=True)
class Segment:
    rank: int
    attempt: int
    kind: str  # a key of COLOURS
    start: float
    end: float
    note: str = ""


@dataclass(frozen=True)
class Marker:
    rank: int | None  # None: the whole job
    attempt: int
    kind: str  # "fault", "checkpoint"
    at: float
    note: str = ""


@dataclass
class Timeline:
    run_id: str
    start: float
    end: float
    ranks: list[int]
    segments: list[Segment] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    stacks: list[tuple[int, int, str]] = field(default_factory=list)  # attempt, rank, text
    breakdown: Breakdown | None = None


def build(events: list[dict[str, Any]]) -> Timeline:
    b = account(events)
    run_id = next((str(e["run_id"]) for e in events if e.get("run_id")), "?")
    tl = Timeline(run_id, b.start, b.end, [], breakdown=b)
    ranks: set[int] = set()
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for e in events:
        a = e.get("attempt")
        if isinstance(a, int) and a >= 0:
            by_attempt.setdefault(a, []).append(e)
    faults = {f.attempt: f for f in b.faults}
    rows = {a.attempt: a for a in b.attempts}
    for a, evs in sorted(by_attempt.items()):
        spawns = {int(e["rank"]): float(e["time"]) for e in evs if e["event"] == Event.WORKER_SPAWN}
        if not spawns:
            continue
        ranks.update(spawns)
        exits = {
            int(e["rank"]): float(e.get("exited_at") or e["time"])
            for e in evs
            if e["event"] == Event.WORKER_EXIT and e.get("rank") is not None
        }
        samples: dict[int, list[tuple[float, int]]] = {}
        for e in evs:
            if e["event"] == Event.PROGRESS and e.get("rank") is not None:
                t = float(e.get("step_time") or e["time"])
                samples.setdefault(int(e["rank"]), []).append((t, int(e["step"])))
        first = {r: min(t for t, _ in sm) for r, sm in samples.items()}
        if a == min(by_attempt):
            # Before the first spawn: the launcher's start, rendezvous, template warm-up.
            for r, spawned in spawns.items():
                tl.segments.append(Segment(r, a, "startup", b.start, spawned, "launcher"))
        hangs = {int(e["global_rank"]): e for e in evs if e["event"] == Event.HANG_DETECTED}
        fault = faults.get(a)
        row = rows.get(a)
        end = row.end if row is not None else b.end
        known = end
        if fault is not None:
            known = min(
                [float(h["time"]) for h in hangs.values()]
                + [t for t in exits.values() if t >= fault.at]
                or [end]
            )
        for r, spawned in sorted(spawns.items()):
            stop = exits.get(r, end)
            go = min(first.get(r, spawned), stop)
            if go > spawned:
                tl.segments.append(Segment(r, a, "startup", spawned, go))
            hang = hangs.get(r)
            if hang is not None:
                age = hang.get("last_heartbeat_age")
                onset = float(hang["time"]) - (float(age) if isinstance(age, int | float) else 0)
                tl.segments.append(Segment(r, a, "running", go, max(go, onset)))
                tl.segments.append(
                    Segment(
                        r, a, "hang", max(go, onset), float(hang["time"]), str(hang.get("kind"))
                    )
                )
                tl.segments.append(Segment(r, a, "teardown", float(hang["time"]), stop))
                if hang.get("stacks"):
                    tl.stacks.append((a, r, str(hang["stacks"])))
            elif fault is not None and stop > known:
                tl.segments.append(Segment(r, a, "running", go, max(go, min(known, stop))))
                tl.segments.append(Segment(r, a, "teardown", max(go, known), stop))
            elif r in samples and row is not None and row.outcome == "succeeded":
                # After the last step the worker only winds down.
                done = min(max(go, last_step_end(sorted(samples[r]))), stop)
                tl.segments.append(Segment(r, a, "running", go, done))
                tl.segments.append(Segment(r, a, "teardown", done, stop))
            else:
                tl.segments.append(Segment(r, a, "running", go, stop))
        if fault is not None:
            note = f"{fault.kind} ({fault.detail}), cost {fault.cost:.2f} s"
            tl.markers.append(Marker(fault.rank, a, "fault", fault.at, note))
            if fault.kind != "hang" and fault.rank in spawns:
                tl.segments.append(
                    Segment(fault.rank, a, "detection", fault.at, max(fault.at, known))
                )
        nxt = min(
            (
                float(e["time"])
                for e in by_attempt.get(a + 1, [])
                if e["event"] == Event.WORKER_SPAWN
            ),
            default=None,
        )
        if row is not None and row.outcome == "failed" and nxt is not None:
            for r in spawns:
                tl.segments.append(Segment(r, a, "restart", row.end, nxt))
        for e in evs:
            if e["event"] == Event.CHECKPOINT_COMMIT and e.get("rank") is not None:
                tl.markers.append(
                    Marker(
                        int(e["rank"]), a, "checkpoint", float(e["time"]), f"step {e.get('step')}"
                    )
                )
    tl.ranks = sorted(ranks)
    return tl


_ROW = 22
_LEFT = 70
_WIDTH = 1000


def _svg(tl: Timeline) -> str:
    span = max(tl.end - tl.start, 1e-9)
    height = 40 + _ROW * len(tl.ranks) + 30

    def x(t: float) -> float:
        return _LEFT + (t - tl.start) / span * (_WIDTH - _LEFT - 10)

    def y(rank: int) -> float:
        return 30 + _ROW * tl.ranks.index(rank)

    out = [
        f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" '
        f'height="{height}" font-family="sans-serif" font-size="11">'
    ]
    for r in tl.ranks:
        out.append(f'<text x="4" y="{y(r) + 14}">rank {r}</text>')
    for s in tl.segments:
        if s.rank not in tl.ranks or s.end <= s.start:
            continue
        tip = f"attempt {s.attempt}, rank {s.rank}: {s.kind} {s.end - s.start:.2f} s"
        if s.note:
            tip += f" ({s.note})"
        out.append(
            f'<rect class="seg {s.kind}" data-attempt="{s.attempt}" data-rank="{s.rank}" '
            f'x="{x(s.start):.1f}" y="{y(s.rank) + 2}" width="{max(x(s.end) - x(s.start), 0.5):.1f}" '
            f'height="{_ROW - 4}" fill="{COLOURS[s.kind]}"><title>{html.escape(tip)}</title></rect>'
        )
    for m in tl.markers:
        rows = [m.rank] if m.rank in tl.ranks else tl.ranks
        for r in rows:
            cx = x(m.at)
            tip = html.escape(f"attempt {m.attempt}: {m.kind} {m.note}")
            if m.kind == "fault":
                out.append(
                    f'<path class="mark fault" data-attempt="{m.attempt}" '
                    f'd="M{cx - 5:.1f},{y(r) + 1} L{cx + 5:.1f},{y(r) + 1} L{cx:.1f},{y(r) + 11} Z" '
                    f'fill="#de2d26"><title>{tip}</title></path>'
                )
            else:
                out.append(
                    f'<line class="mark checkpoint" data-attempt="{m.attempt}" x1="{cx:.1f}" '
                    f'x2="{cx:.1f}" y1="{y(r)}" y2="{y(r) + _ROW}" stroke="#08519c" '
                    f'stroke-width="2"><title>{tip}</title></line>'
                )
    axis = 30 + _ROW * len(tl.ranks) + 14
    for i in range(6):
        t = tl.start + span * i / 5
        out.append(f'<text x="{x(t) - 10:.1f}" y="{axis}">{t - tl.start:.1f}s</text>')
    if tl.breakdown is not None:
        for row in tl.breakdown.attempts:
            out.append(
                f'<text class="attempt-label" x="{x(row.start) + 2:.1f}" y="18">'
                f"attempt {row.attempt} ({row.outcome})</text>"
            )
    out.append("</svg>")
    return "\n".join(out)


def to_html(tl: Timeline) -> str:
    b = tl.breakdown
    legend = "".join(
        f'<span class="key"><i style="background:{c}"></i>{k}</span>' for k, c in COLOURS.items()
    )
    legend += '<span class="key"><i style="background:#de2d26"></i>fault</span>'
    legend += '<span class="key"><i style="background:#08519c"></i>checkpoint commit</span>'
    rows = ""
    if b is not None:
        for cat in CATEGORIES:
            share = 100 * b.seconds[cat] / b.wall if b.wall > 0 else 0.0
            rows += (
                f'<tr class="cat" data-category="{cat}"><td>{cat}</td>'
                f"<td>{b.seconds[cat]:.2f}</td><td>{share:.1f}%</td></tr>"
            )
        rows += f"<tr><th>total</th><th>{b.wall:.2f}</th><th>100%</th></tr>"
    faults = ""
    if b is not None and b.faults:
        items = "".join(
            f'<li class="fault">attempt {f.attempt}: rank {html.escape(str(f.rank))} '
            f"{html.escape(f.kind)} "
            f"({html.escape(f.detail)}), cost {f.cost:.2f} s, {f.steps_lost} step(s) redone</li>"
            for f in b.faults
        )
        faults = f"<h2>Faults</h2><ul>{items}</ul>"
    stacks = "".join(
        f'<details class="stacks"><summary>attempt {a}, rank {r}: stacks of the hang</summary>'
        f"<pre>{html.escape(text)}</pre></details>"
        for a, r, text in tl.stacks
    )
    goodput = f"{100 * b.goodput:.1f}%" if b is not None else "?"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>stalwart run {html.escape(tl.run_id)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; }} td, th {{ padding: 2px 10px; text-align: right; }}
td:first-child {{ text-align: left; }}
.key {{ margin-right: 1em; font-size: 12px; }}
.key i {{ display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: middle; }}
pre {{ font-size: 11px; background: #f4f4f4; padding: 6px; overflow-x: auto; }}
</style></head>
<body>
<h1>run {html.escape(tl.run_id)}</h1>
<p id="summary">{len(b.attempts) if b else 0} attempt(s), {tl.end - tl.start:.1f} s,
goodput {goodput}</p>
<div id="legend">{legend}</div>
{_svg(tl)}
<h2>Where the time went</h2>
<table id="breakdown"><tr><th>category</th><th>seconds</th><th>share</th></tr>{rows}</table>
{faults}
{stacks}
</body></html>
"""


def png_drawer(tl: Timeline) -> Callable[[BinaryIO], None]:
    """A function that draws *tl* as a PNG into an open file; RuntimeError (one line)
    at once when matplotlib is missing, before any file is made."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot
    except ImportError:
        raise RuntimeError("--png needs matplotlib: pip install 'stalwart[report]'") from None
    return lambda fh: _draw_png(tl, fh)


def _draw_png(tl: Timeline, fh: BinaryIO) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(12, 1.8 + 0.4 * max(len(tl.ranks), 1)))
    index = {r: i for i, r in enumerate(tl.ranks)}
    for s in tl.segments:
        if s.rank in index and s.end > s.start:
            ax.broken_barh(
                [(s.start - tl.start, s.end - s.start)],
                (index[s.rank] - 0.4, 0.8),
                facecolors=COLOURS[s.kind],
            )
    for m in tl.markers:
        rows = [index[m.rank]] if m.rank in index else list(index.values())
        for i in rows:
            if m.kind == "fault":
                ax.plot(m.at - tl.start, i + 0.45, marker="v", color="#de2d26", markersize=9)
            else:
                ax.vlines(m.at - tl.start, i - 0.4, i + 0.4, colors="#08519c", linewidth=2)
    if tl.breakdown is not None:
        for row in tl.breakdown.attempts:
            ax.axvline(row.start - tl.start, color="#555", linewidth=0.5, linestyle=":")
            ax.text(
                row.start - tl.start, len(tl.ranks) - 0.35, f" attempt {row.attempt}", fontsize=8
            )
    ax.set_yticks(range(len(tl.ranks)), [f"rank {r}" for r in tl.ranks])
    ax.set_ylim(-0.6, len(tl.ranks) - 0.1)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since launch")
    ax.set_xlim(0, max(tl.end - tl.start, 1e-3))
    goodput = f", goodput {100 * tl.breakdown.goodput:.1f}%" if tl.breakdown else ""
    # The run id is the user's text: matplotlib must not read "$...$" in it as math.
    title = printable(tl.run_id)
    ax.set_title(f"run {title}{goodput}", parse_math=False)
    handles = [Patch(color=c, label=k) for k, c in COLOURS.items()]
    handles += [Patch(color="#de2d26", label="fault"), Patch(color="#08519c", label="checkpoint")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(fh, format="png", dpi=110)
    plt.close(fig)
