"""Systems heterogeneity: each client's device profile, and the simulated clock of a run.

A client's **profile** is its compute speed (samples trained a second) and its upload and
download bandwidths (bytes a second). ``device-profiles = lognormal`` draws them from the seed,
each independently log-normal around its median (``device-compute``, ``device-upload``,
``device-download``; MB are 10^6 bytes) with log-standard deviation ``device-spread``; or a
trace file gives them (:func:`read_trace`). The same seed gives the same profiles in every
process and on every engine: they depend on nothing else.

A client's **time in a training round** (:meth:`DeviceProfiles.seconds`) is its download of what
the server sent it, its compute for the samples it trains on, and its upload of what it replied,
from its profile and the bytes that really travel (the messages' array records as the engines
count them). The samples it trains on are the server's own count, not the client's claim: its
training samples times ``local-epochs``, or ``local-steps`` times ``batch-size`` when the steps
are capped. A synchronous round (:func:`close_round`) takes the replies in order of arrival:
with ``over-selection`` it samples more clients and uses the first ones it asked for, with
``round-deadline`` it drops those that would arrive later; the round lasts until its last used
reply arrives (or its deadline, when a reply was dropped for it). The clock (``sim-time``) is
the sum of the training rounds' simulated seconds; evaluation rounds are not timed.

Dropped clients trained all the same (the simulation runs every sampled client): as on a real
device, each keeps what it trained (its saved state), and only the server leaves its update
out.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pflalign.server.sampling import sorted_ids
from pflalign.settings.options import ConfigError

#: the random stream of the profiles under the run's seed
PROFILE_STREAM = 20
#: bytes in a MB of the bandwidth keys and trace files
MB = 1e6
NONE, LOGNORMAL = "none", "lognormal"
#: a trace file's columns (compute in samples a second, upload and download in MB a second)
TRACE_COLUMNS = ("client", "compute", "upload", "download")


@dataclass(frozen=True)
class DeviceProfiles:
    """Every client's compute speed (samples/s) and upload and download bandwidths (bytes/s)."""

    compute: np.ndarray
    upload: np.ndarray
    download: np.ndarray

    def seconds(self, client: int, down_bytes: int, samples: int, up_bytes: int) -> float:
        """Client ``client``'s simulated time for a round: download, train, upload."""
        return (down_bytes / float(self.download[client]) + samples / float(self.compute[client])
                + up_bytes / float(self.upload[client]))


def drawn_profiles(num_clients: int, seed: int, compute: float, upload_mb: float,
                   download_mb: float, spread: float) -> DeviceProfiles:
    """Log-normal profiles: each of the three ``median * exp(spread * N(0, 1))``, independent."""
    normal = np.random.default_rng([seed, PROFILE_STREAM]).standard_normal((3, num_clients))
    factors = np.exp(spread * normal)
    return DeviceProfiles(compute=compute * factors[0], upload=upload_mb * MB * factors[1],
                          download=download_mb * MB * factors[2])


def _trace_rows(path: Path) -> list[Mapping[str, object]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"device-profiles = {str(path)!r}: the trace file does not exist.") \
            from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"device-profiles = {str(path)!r} cannot be read ({err}).") from None
    if path.suffix.lower() == ".json":
        try:
            rows = json.loads(text)
        except ValueError as err:
            raise ConfigError(f"device-profiles = {str(path)!r} is not valid JSON ({err}).") \
                from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ConfigError(f"device-profiles = {str(path)!r}: a JSON trace is a list of "
                              f"objects with the keys {', '.join(TRACE_COLUMNS)}.")
        return rows
    reader = csv.DictReader(text.splitlines())
    missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise ConfigError(f"device-profiles = {str(path)!r}: a CSV trace needs the header "
                          f"{','.join(TRACE_COLUMNS)} (missing: {', '.join(missing)}).")
    return list(reader)


def read_trace(path: str | Path, num_clients: int) -> DeviceProfiles:
    """Profiles from a trace file: CSV with the header ``client,compute,upload,download``, or a
    JSON list of objects with those keys; one row per client ``0..num_clients-1`` (extra rows
    for other ids are an error too), each speed a positive number (compute in samples a second,
    upload and download in MB a second)."""
    path = Path(path)
    rows = _trace_rows(path)
    values = np.full((3, num_clients), np.nan)
    is_json = path.suffix.lower() == ".json"
    for line, row in enumerate(rows, start=1 if is_json else 2):
        where = f"device-profiles = {str(path)!r}, {'entry' if is_json else 'line'} {line}"
        try:
            client = int(str(row["client"]).strip())
            speeds = [float(str(row[c]).strip()) for c in TRACE_COLUMNS[1:]]
        except (KeyError, ValueError, TypeError):
            raise ConfigError(f"{where}: give client as a whole number and compute, upload and "
                              "download as numbers.") from None
        if not 0 <= client < num_clients:
            raise ConfigError(f"{where}: client {client} is outside this run's clients "
                              f"0..{num_clients - 1} (num-clients + num-unseen-clients).")
        if not all(math.isfinite(v) and v > 0 for v in speeds):
            raise ConfigError(f"{where}: client {client}'s speeds must be positive numbers, got "
                              f"{speeds}.")
        if not np.isnan(values[0, client]):
            raise ConfigError(f"{where}: client {client} appears twice.")
        values[:, client] = speeds
    missing = np.flatnonzero(np.isnan(values[0]))
    if len(missing):
        raise ConfigError(f"device-profiles = {str(path)!r} has no row for {len(missing)} of the "
                          f"run's {num_clients} clients (the first: {int(missing[0])}); give one "
                          "row per client.")
    return DeviceProfiles(compute=values[0], upload=values[1] * MB, download=values[2] * MB)


def check_profiles_key(value: str) -> None:
    """``device-profiles`` is none, lognormal or a .csv/.json path (read when the run starts,
    with the run's client count; the file must exist now)."""
    if value in (NONE, LOGNORMAL):
        return
    path = Path(value).expanduser()
    if path.suffix.lower() not in (".csv", ".json"):
        raise ConfigError(f"device-profiles = {value!r}: choose none, lognormal, or a trace file "
                          "ending in .csv or .json.")
    if not path.is_file():
        raise ConfigError(f"device-profiles = {value!r}: the trace file does not exist.")


def profiles_of(run: object, num_clients: int) -> DeviceProfiles | None:
    """The run's profiles (None for ``device-profiles = none``)."""
    kind = run.device_profiles  # type: ignore[attr-defined]
    if kind == NONE:
        return None
    if kind == LOGNORMAL:
        return drawn_profiles(num_clients, run.seed, run.device_compute,  # type: ignore
                              run.device_upload, run.device_download, run.device_spread)
    return read_trace(Path(kind).expanduser(), num_clients)


@dataclass(frozen=True)
class RoundClose:
    """How a synchronous round closed: the replies it uses (indices into the round's replies, in
    their order), how many arrived late (after the deadline) or were not needed (over-selection),
    and the round's simulated seconds."""

    used: list[int]
    late: int
    unneeded: int
    seconds: float


def close_round(arrivals: Sequence[float | None], wanted: int, deadline: float) -> RoundClose:
    """Close a synchronous round over the replies' arrival times (None: no reply arrives):
    the first ``wanted`` to arrive (ties by their order) that arrive by ``deadline`` (0: no
    deadline)."""
    order = sorted((t, i) for i, t in enumerate(arrivals) if t is not None)
    on_time = [(t, i) for t, i in order if deadline <= 0 or t <= deadline]
    late = len(order) - len(on_time)
    used = on_time[:wanted]
    unneeded = len(on_time) - len(used)
    if late and len(used) < wanted:
        seconds = deadline  # it waited for replies that did not come in time
    else:
        seconds = used[-1][0] if used else (deadline if deadline > 0 else 0.0)
    return RoundClose(used=sorted(i for _, i in used), late=late, unneeded=unneeded,
                      seconds=float(seconds))


#: the random stream of the clients' diurnal phases, and of sampling among available clients
PHASE_STREAM, AVAILABLE_STREAM = 21, 22
ALWAYS, DIURNAL = "always", "diurnal"
DAY = 24 * 3600.0


@dataclass(frozen=True)
class Availability:
    """When each client can be reached: a diurnal window of ``hours`` a day, opening at a
    per-client phase (client ``c`` is reachable at simulated time ``t`` when
    ``(t / 3600 + phase[c]) mod 24 < hours``), as devices train only while idle and charging
    (Bonawitz et al. 2019)."""

    phase: np.ndarray
    hours: float

    def available(self, clients: Sequence[int], time: float) -> list[int]:
        """The clients of ``clients`` reachable at ``time``."""
        return self.available_ids(np.asarray(clients, dtype=np.int64), time).tolist()

    def available_ids(self, ids: np.ndarray, time: float) -> np.ndarray:
        """:meth:`available` of an int64 array, as one (a round's draw among a million
        clients, with no Python int per client)."""
        hour = np.mod(time / 3600.0 + self.phase[ids], 24.0)
        return ids[hour < self.hours]

    def next_opening(self, clients: Sequence[int], time: float) -> float:
        """The first time at or after ``time`` when one of ``clients`` is reachable."""
        ids = np.asarray(clients, dtype=np.int64)
        hour = np.mod(time / 3600.0 + self.phase[ids], 24.0)
        wait = np.where(hour < self.hours, 0.0, (24.0 - hour) * 3600.0)
        return float(time + wait.min())


#: a trace file's optional column of availability windows (``availability = trace``)
WINDOWS = "windows"
TRACE = "trace"


@dataclass(frozen=True)
class WindowAvailability:
    """When each client can be reached, from a trace file's windows: intervals of the day
    (seconds from midnight, repeating every simulated day), each ``[start, end)``, flattened
    over the clients (``owner[k]`` is the client of window ``k``)."""

    owner: np.ndarray
    start: np.ndarray
    end: np.ndarray

    def _open(self, clients: Sequence[int], time: float) -> tuple[np.ndarray, np.ndarray]:
        mine = np.isin(self.owner, np.asarray(clients, dtype=np.int64))
        clock = float(np.mod(time, DAY))
        return mine, mine & (self.start <= clock) & (clock < self.end)

    def available(self, clients: Sequence[int], time: float) -> list[int]:
        """The clients of ``clients`` reachable at ``time``, in the order given."""
        _, inside = self._open(clients, time)
        reachable = set(self.owner[inside].tolist())
        return [int(c) for c in clients if int(c) in reachable]

    def available_ids(self, ids: np.ndarray, time: float) -> np.ndarray:
        """:meth:`available` of an int64 array, as one."""
        _, inside = self._open(ids, time)
        return ids[np.isin(ids, self.owner[inside])]

    def next_opening(self, clients: Sequence[int], time: float) -> float:
        """The first time at or after ``time`` when one of ``clients`` is reachable."""
        mine, inside = self._open(clients, time)
        if inside.any():
            return float(time)
        wait = np.mod(self.start[mine] - np.mod(time, DAY), DAY)
        return float(time + wait.min())


def _windows(value: object, where: str, client: int) -> list[tuple[float, float]]:
    """One trace row's windows: ``"0-8;20-24"`` (hours of the day) in CSV, ``[[0, 8], [20,
    24]]`` in JSON; each start before its end, within 0..24, in increasing order and not
    overlapping."""
    try:
        if isinstance(value, str):
            pairs = [part.split("-") for part in value.replace(" ", "").split(";") if part]
        else:
            pairs = list(value)  # type: ignore[call-overload]
        windows = [(float(a), float(b)) for a, b in pairs]
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: client {client}'s windows {value!r} are not start-end pairs "
                          "of hours of the day, e.g. '0-8;20-24' (JSON: [[0, 8], [20, 24]]).") \
            from None
    if not windows:
        raise ConfigError(f"{where}: client {client} has no availability window; give at least "
                          "one, e.g. '0-24' for always.")
    previous = 0.0
    for start, end in windows:
        if not (math.isfinite(start) and math.isfinite(end) and 0 <= start < end <= 24):
            raise ConfigError(f"{where}: client {client}'s window {start:g}-{end:g} is not "
                              "within the day: 0 <= start < end <= 24 (hours).")
        if start < previous:
            raise ConfigError(f"{where}: client {client}'s windows are out of order or overlap "
                              f"(one starts at {start:g} h, before {previous:g} h); list them "
                              "in increasing order.")
        previous = end
    return windows


def read_windows(path: str | Path, num_clients: int) -> WindowAvailability | None:
    """The availability windows of a trace file's ``windows`` column, one entry per client
    (None when the file has no such column)."""
    path = Path(path)
    rows = _trace_rows(path)
    if not any(WINDOWS in row for row in rows):
        return None
    is_json = path.suffix.lower() == ".json"
    owner, start, end = [], [], []
    for line, row in enumerate(rows, start=1 if is_json else 2):
        where = f"device-profiles = {str(path)!r}, {'entry' if is_json else 'line'} {line}"
        client = int(str(row["client"]).strip())  # checked by read_trace
        for a, b in _windows(row.get(WINDOWS), where, client):
            owner.append(client)
            start.append(a * 3600.0)
            end.append(b * 3600.0)
    return WindowAvailability(np.asarray(owner, np.int64), np.asarray(start),
                              np.asarray(end))


def availability_of(run: object, num_clients: int) -> Availability | WindowAvailability | None:
    """The run's availability (None for ``availability = always``)."""
    if run.availability == ALWAYS:  # type: ignore[attr-defined]
        return None
    if run.availability == TRACE:  # type: ignore[attr-defined]
        return read_windows(Path(run.device_profiles).expanduser(),  # type: ignore
                            num_clients)
    phase = np.random.default_rng([run.seed, PHASE_STREAM]).uniform(  # type: ignore
        0.0, 24.0, num_clients)
    return Availability(phase=phase, hours=float(run.available_hours))  # type: ignore


def sample_available(pool: Sequence[int], count: int, seed: int, server_round: int) -> list[int]:
    """``min(count, |pool|)`` distinct clients of ``pool``, sorted, drawn by (seed, round)."""
    ordered = sorted_ids(pool)
    take = min(count, len(ordered))
    rng = np.random.default_rng([seed, server_round, AVAILABLE_STREAM])
    return sorted(int(c) for c in rng.choice(ordered, size=take, replace=False))
