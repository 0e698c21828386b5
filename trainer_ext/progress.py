"""Progress of long phases, shaped by where the output goes: a bar on a terminal, a log line every few seconds in a
log file or a pipe. The one progress helper of the package (tokenizing, BPE training, shard writing, teacher
caching, the comparison's stages, evaluation).

A tqdm bar redraws itself with carriage returns: in a file each refresh is one more line (a 10-minute comparison
wrote 1,308 of them), and tqdm's `disable=None` hides the bar there instead, leaving hours without a word (a large
teacher inside one cache shard). Where stdout or stderr is not a terminal, `Progress` draws no bar and logs

    Packing: 1.20M/5.00M tok (24%), 41.2k tok/s, 1m 32s left, elapsed 29s, documents=1,234

every `interval` seconds (the environment variable HF_RECURRENT_PROGRESS_INTERVAL, default 30), from a background
thread: a phase stuck in one long call (BPE merges in Rust, one forward of a large teacher) still shows that it is
alive. A phase that logged a line logs a last one when it ends; a phase shorter than the interval logs nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import weakref

from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

INTERVAL_ENV = "HF_RECURRENT_PROGRESS_INTERVAL"
DEFAULT_INTERVAL = 30.0


def interval_seconds() -> float:
    """Seconds between two progress lines in a log: HF_RECURRENT_PROGRESS_INTERVAL, else DEFAULT_INTERVAL."""
    value = os.environ.get(INTERVAL_ENV, "").strip()
    if not value:
        return DEFAULT_INTERVAL
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ValueError(f"{INTERVAL_ENV}={value!r} must be a number of seconds > 0; unset it for the default "
                         f"{DEFAULT_INTERVAL:g}.")
    return seconds


def _is_terminal(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


def on_terminal() -> bool:
    """True where a person watches both output streams. With either one redirected the output is being kept (a log
    file, `| tee`, nohup), and bars there would only flood it."""
    return _is_terminal(sys.stdout) and _is_terminal(sys.stderr)


def _format_amount(value: float, unit_scale: bool = False) -> str:
    """A progress line's count: "1,234", "12.5", or with `unit_scale` tqdm's "1.20M" (not hub.model_card's
    format_count, which tables and cards use)."""
    if unit_scale:
        return tqdm.format_sizeof(value, divisor=1000).strip()
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.1f}"
    return f"{int(value):,}"


def _format_duration(seconds: float) -> str:
    """"42s", "3m 05s", "2h 07m"."""
    seconds = int(round(max(seconds, 0)))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {seconds:02d}s"
    return f"{seconds}s"


def format_rate(per_second: float, unit: str, unit_scale: bool = False) -> str:
    """Units per second, or seconds per unit for slow phases ("12.0 s/stage" says more than "0.08 stage/s")."""
    if per_second >= 1:
        return f"{_format_amount(float(round(per_second, 1)), unit_scale)} {unit}/s"
    return f"{1 / per_second:,.1f} s/{unit}"


class Progress:
    """A progress bar on a terminal, a progress line in the log every `interval` seconds elsewhere; the subset of
    tqdm's interface the package uses:

        with Progress(total=num_tokens, desc="Packing", unit="tok", unit_scale=True) as progress:
            progress.update(n)
            progress.set_postfix(documents=f"{count:,}")
        for batch in Progress(loader, desc="eval"): ...

    `disable=True` shows nothing at all (a caller that shows its own progress). `initial` counts work done by an
    earlier start: it counts towards done/total but not towards the rate. Other keywords go to tqdm's bar.
    """

    def __init__(self, iterable=None, *, total: float | None = None, desc: str = "", unit: str = "it",
                 initial: float = 0, unit_scale: bool = False, disable: bool = False, interval: float | None = None,
                 **bar_options):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.total, self.desc, self.unit, self.unit_scale = iterable, total, desc, unit, unit_scale
        self.n = initial
        self._initial = initial
        self._postfix = ""
        self._start = time.monotonic()
        self._bar = None
        self._thread = None
        self._stop = threading.Event()
        self._logged = False
        if disable:
            return
        if on_terminal():
            self._bar = tqdm(total=total, desc=desc, unit=unit, initial=initial, unit_scale=unit_scale,
                             **bar_options)
            return
        self.interval = interval_seconds() if interval is None else interval
        # The thread holds the progress weakly: one never closed (an exception past its owner) stops logging once
        # it is collected, rather than every interval for the rest of the process.
        self._thread = threading.Thread(target=_log_every_interval, name=f"progress: {desc}", daemon=True,
                                        args=(weakref.ref(self), self._stop, self.interval))
        self._thread.start()

    # -- the tqdm surface

    def __iter__(self):
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)

    def set_postfix_str(self, postfix: str) -> None:
        self._postfix = postfix
        if self._bar is not None:
            self._bar.set_postfix_str(postfix)

    def set_postfix(self, **values) -> None:
        self.set_postfix_str(", ".join(f"{key}={value}" for key, value in values.items()))

    def __del__(self):
        if hasattr(self, "_stop"):
            self._stop.set()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            if self._thread is not threading.current_thread():
                self._thread.join()
            self._thread = None
            # A phase that lasted an interval or more says that it ended (also when the thread, busy or starved of
            # the GIL, logged no line during it); a short one stays silent.
            if self._logged or time.monotonic() - self._start >= self.interval:
                logger.info("%s", self.status(finished=True))
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    # -- the log line

    def status(self, finished: bool = False) -> str:
        """The progress line: done/total, rate, time left, time elapsed, the postfix."""
        elapsed = time.monotonic() - self._start
        done = _format_amount(self.n, self.unit_scale)
        if self.total:
            done += f"/{_format_amount(self.total, self.unit_scale)} {self.unit} ({100 * self.n / self.total:.0f}%)"
        else:
            done += f" {self.unit}"
        parts = [f"{self.desc}: {done}" if self.desc else done]
        rate = (self.n - self._initial) / elapsed if elapsed > 0 else 0.0
        if rate > 0:
            parts.append(format_rate(rate, self.unit, self.unit_scale))
        if not finished and self.total and rate > 0 and self.n < self.total:
            parts.append(f"{_format_duration((self.total - self.n) / rate)} left")
        parts.append(f"{'done in' if finished else 'elapsed'} {_format_duration(elapsed)}")
        if self._postfix:
            parts.append(self._postfix)
        return ", ".join(parts)


def _log_every_interval(progress_ref, stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        progress = progress_ref()
        if progress is None:
            return
        logger.info("%s", progress.status())
        progress._logged = True
        del progress


@contextlib.contextmanager
def library_bars_off():
    """Silence the progress bars of datasets, transformers (e.g. "Writing model shards" at every checkpoint) and
    huggingface_hub inside the block, each by the library's own switch, restored afterwards."""
    import datasets
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as transformers_logging

    switches = []
    if not datasets.are_progress_bars_disabled():
        datasets.disable_progress_bars()
        switches.append(datasets.enable_progress_bars)
    if transformers_logging.is_progress_bar_enabled():
        transformers_logging.disable_progress_bar()
        switches.append(transformers_logging.enable_progress_bar)
    if not hub_utils.are_progress_bars_disabled():
        hub_utils.disable_progress_bars()
        switches.append(hub_utils.enable_progress_bars)
    try:
        yield
    finally:
        for enable in switches:
            enable()


def library_bars_off_without_terminal():
    """`library_bars_off()` where the output is kept (no terminal): their carriage-return bars would flood a log."""
    return contextlib.nullcontext() if on_terminal() else library_bars_off()
