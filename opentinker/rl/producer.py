"""The producer: a job's groups of episodes played continuously, a step's groups taken by the trainer.

Groups are numbered in the order their tasks are drawn; group g belongs to step g // prompts_per_step.
The trainer publishes one version a step; the producer starts group g once the versions of all
steps before step(g) but the last max_staleness (k) of them are published,
keeps at most k + 1 steps of groups started and not yet taken, and at most one step's worth of groups
playing at once, and plays each group's episodes as streams (opentinker.agent.loop) on the engine,
which takes newer weights between decode steps. (Why the second bound: playing groups share the
engine's batch, so groups of later steps started beside the next step's slow those the trainer waits
for; with 3 steps of groups at once, k = 2's first step waited 58 s for its groups against k = 0's
12 s on the 2-core CPU.)
So every token of a group is drawn by a version at most k behind the version that trains on it:
k = 0 is the synchronous job (a step's groups start once the previous update is published), k > 0
plays up to k steps ahead while the trainer updates. A group that does break the bound anyway (a
guard: the start rule prevents it) is dropped and counted, never trained.

`take(step)` waits for the step's groups (that wait is the rollout task's duration) and returns
them in order; each group's episodes draw from generators seeded by (seed, group, episode), so a
group gets the same task and seeds whenever it runs (which version draws each token depends on when
updates land: docs/training.md, "What k > 0 reproduces"). The environment's state before each group's task was drawn
is kept, so a checkpoint after step s records the position of the first group not trained: a
resumed job draws those tasks again and trains no group twice.

No part dies silently: a task draw that raises (a generator that only yields validation tasks, an
environment server answering garbage) stops the producer and `take` raises that error at once, as a
group's failure does, so the job fails with the cause instead of waiting for groups that never come.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from opentinker.core.trajectory import Trajectory


@dataclass
class Group:
    index: int
    task: dict[str, Any]
    env_state: dict[str, Any]  # the environment's state before this group's task was drawn
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None  # when its last episode ended (time.monotonic)
    trajectories: list[Trajectory] | None = None
    error: BaseException | None = None


class Producer:
    def __init__(self, draw: Callable[[], tuple[dict[str, Any], dict[str, Any]]], play: Callable[[Group], list[Trajectory]],
                 prompts_per_step: int, max_staleness: int, first_group: int = 0, version: int = 0):
        """`draw()`: the next task and the environment's state before it was drawn; `play(group)`:
        its episodes' records."""
        self.draw, self.play = draw, play
        self.per_step, self.k = prompts_per_step, max_staleness
        self.next_group = first_group  # the next group to start
        self.next_taken = first_group  # the first group not taken yet
        self.version = version
        self.first_step, self.first_version = first_group // prompts_per_step, version  # one update a step from here
        self.groups: dict[int, Group] = {}
        self.dropped = 0
        self.failure: BaseException | None = None  # what stopped the producer's own thread (a task draw that raised)
        self.condition = threading.Condition()
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="producer", daemon=True)
        self.thread.start()

    # -- the trainer's side ---------------------------------------------------------------------
    def publish(self, version: int) -> None:
        """The trainer is at `version` now: groups of steps up to version + k may start."""
        with self.condition:
            self.version = max(self.version, version)
            self.condition.notify_all()

    def take(self, step: int) -> list[Group]:
        """The step's groups, in order, once all are played (a group that failed raises its error)."""
        wanted = range(step * self.per_step, (step + 1) * self.per_step)
        with self.condition:
            if self.next_taken != wanted[0]:
                raise RuntimeError(f"the producer's next step starts at group {self.next_taken}, asked for step {step}")
            if self.next_group <= wanted[-1] and not self._may_start(ignore_room=True):  # nothing would ever publish while we wait
                raise RuntimeError(f"step {step}'s episodes start once the update of step {step - 1 - self.k} is published "
                                   f"(max_staleness {self.k}): update before the next rollout")
            self.condition.wait_for(lambda: self.stopped or self.failure is not None or all(self._done(g) for g in wanted))
            if self.failure is not None and not all(self._done(g) for g in wanted):
                raise self.failure
            if self.stopped:
                raise RuntimeError("the producer stopped")
            taken = [self.groups.pop(g) for g in wanted]
            self.next_taken = wanted[-1] + 1
            self.condition.notify_all()
        for group in taken:
            if group.error is not None:
                raise group.error
        return taken

    def env_state_after(self, step: int, current: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The environment's state for a checkpoint after `step`: before the first group not trained was drawn."""
        with self.condition:
            group = self.groups.get((step + 1) * self.per_step)
            return group.env_state if group is not None else current()

    def waiting(self) -> tuple[int, int]:
        """(groups played and waiting to be taken, groups playing now)."""
        with self.condition:
            playing = self._playing()
            return len(self.groups) - playing, playing

    def stop(self) -> None:
        with self.condition:
            self.stopped = True
            self.condition.notify_all()

    # -- the producer's side --------------------------------------------------------------------
    def _done(self, index: int) -> bool:
        group = self.groups.get(index)
        return group is not None and (group.trajectories is not None or group.error is not None)

    def _playing(self) -> int:
        """Groups started and not done (under the condition's lock)."""
        return sum(not self._done(g) for g in self.groups)

    def _may_start(self, ignore_room: bool = False) -> bool:
        """Group `next_group` starts when the trainer has published the updates of all steps but its last k
        before it (counted from where the producer started), at most k + 1 steps are started, not taken,
        and fewer than a step's worth of groups are playing."""
        steps_before = self.next_group // self.per_step - self.first_step
        ahead = self.next_group - self.next_taken
        room = ahead < (self.k + 1) * self.per_step and self._playing() < self.per_step
        return self.version - self.first_version >= steps_before - self.k and (ignore_room or room)

    def _run(self) -> None:
        try:
            self._start_groups()
        except BaseException as err:  # noqa: BLE001 - the trainer's next take raises it (the job fails with the cause)
            with self.condition:
                self.failure = err
                self.condition.notify_all()

    def _start_groups(self) -> None:
        while True:
            with self.condition:
                self.condition.wait_for(lambda: self.stopped or self._may_start())
                if self.stopped:
                    return
                task, env_state = self.draw()
                group = self.groups[self.next_group] = Group(self.next_group, task, env_state)
                self.next_group += 1
            threading.Thread(target=self._play, args=(group,), name=f"group-{group.index}", daemon=True).start()

    def _play(self, group: Group) -> None:
        try:
            trajectories = self.play(group)
        except BaseException as err:  # noqa: BLE001 - the engine failed: the step that takes it raises
            trajectories, group.error = None, err
        with self.condition:
            group.trajectories, group.finished = trajectories, time.monotonic()
            self.condition.notify_all()
