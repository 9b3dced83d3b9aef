"""The token record of one episode: the single place that owns ids, masks, logprobs and versions.

Written only by the agent loop (append-only), read by the trainer and the algorithms. Earlier
tokens are never re-tokenized: what the policy sampled is exactly what the trainer scores. For a
vision-language policy the record also keeps the images it shows: their image tokens are in
`token_ids` (loss mask 0, expanded once by the processor), their pixel inputs beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Turn:
    """One GENERATING + INTERACTING round: the action text and the environment's answer."""

    action: str
    observation: str | None = None
    reward: float = 0.0
    state: str | None = None  # the state the action led to, as the game names it (`info["state"]`; None: its observation)
    sampled_start: int = 0
    sampled_end: int = 0


@dataclass
class VisualInput:
    """Images one piece of the record shows: the pictures, and the tiles their image tokens stand
    for, as the processor made them once (pixel values [tiles, C, H, W], pixel mask [tiles, H, W]);
    `at` is where the piece's tokens start in the record."""

    images: list[Any]
    pixel_values: Any
    pixel_mask: Any
    at: int = 0


@dataclass
class Trajectory:
    """An episode as tokens. `loss_mask[i] == 1` exactly where token i was sampled by the policy;
    `token_versions[i]` is the policy version that drew it (-1 where nothing was drawn), and
    `policy_version` the oldest of them (a sequence may span versions: weights updated in flight)."""

    prompt_ids: list[int]
    group_id: int = 0
    policy_version: int = 0
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    env_seconds: list[float] = field(default_factory=list)  # how long each environment step took
    turn_seconds: list[float] = field(default_factory=list)  # how long each turn waited for the engine's reply
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    task: dict[str, Any] = field(default_factory=dict)
    failed: bool = False
    failure: str | None = None
    stop_reason: str | None = None
    truncation: str | None = None  # why the record stopped at max_total_tokens, with the numbers
    info: dict[str, Any] = field(default_factory=dict)
    images: list[VisualInput] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)
            self.loss_mask = [0] * len(self.prompt_ids)
            self.sampling_logprobs = [0.0] * len(self.prompt_ids)
        if len(self.token_versions) < len(self.token_ids):
            self.token_versions += [-1] * (len(self.token_ids) - len(self.token_versions))

    def __len__(self) -> int:
        return len(self.token_ids)

    def append_sampled(self, ids: list[int], logprobs: list[float], action: str, versions: list[int] | None = None) -> None:
        """Add the policy's tokens (trainable), each with the version that drew it (default: the
        record's `policy_version`), and open a new turn."""
        if len(ids) != len(logprobs) or (versions is not None and len(versions) != len(ids)):
            raise ValueError("each sampled token needs its sampling logprob (and its version)")
        versions = [int(v) for v in versions] if versions is not None else [self.policy_version] * len(ids)
        if versions:
            drawn = [v for v in self.token_versions if v >= 0]
            self.policy_version = min(drawn + versions)
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.sampling_logprobs.extend(float(x) for x in logprobs)
        self.token_versions.extend(versions)
        self.turns.append(Turn(action=action, sampled_start=start, sampled_end=len(self.token_ids)))

    def append_observation(self, ids: list[int], observation: str, visual: VisualInput | None = None) -> None:
        """Add the environment's answer as context (not trained on), with the images it shows."""
        if visual is not None:
            visual.at = len(self.token_ids)
            self.images.append(visual)
        self.token_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.sampling_logprobs.extend([0.0] * len(ids))
        self.token_versions.extend([-1] * len(ids))
        if self.turns:
            self.turns[-1].observation = observation

    @property
    def reward(self) -> float:
        """Episode return: the sum of per-turn rewards; a failed episode earns 0."""
        return 0.0 if self.failed else float(sum(t.reward for t in self.turns))

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    @property
    def sampled_versions(self) -> list[int]:
        """The policy version that drew each sampled token (in order)."""
        return [v for v, m in zip(self.token_versions, self.loss_mask) if m]

    def last_trainable_index(self) -> int | None:
        for i in range(len(self.loss_mask) - 1, -1, -1):
            if self.loss_mask[i]:
                return i
        return None

    def token_rewards(self) -> list[float]:
        """Reward placed on the last trainable token, zero elsewhere (the outcome-reward convention)."""
        out = [0.0] * len(self.token_ids)
        last = self.last_trainable_index()
        if last is not None:
            out[last] = self.reward
        return out

    def split_by_turn(self, gamma: float = 1.0) -> list["Trajectory"]:
        """Per-turn credit: one record per turn, trained as its own sample.

        Turn j keeps everything before its sampled tokens as context (mask 0) and its own tokens
        (mask 1, same sampling logprobs), and earns the return from that turn on,
        G_j = r_j + gamma * G_{j+1}. Records that follow the turn are not part of the sample.
        """
        if self.failed or not self.turns:
            return [self]
        returns, running = [], 0.0
        for turn in reversed(self.turns):
            running = turn.reward + gamma * running
            returns.append(running)
        returns.reverse()
        out = []
        for j, (turn, ret) in enumerate(zip(self.turns, returns)):
            start, end = turn.sampled_start, turn.sampled_end
            piece = Trajectory(
                prompt_ids=list(self.token_ids[:start]), group_id=self.group_id, policy_version=self.policy_version,
                task=self.task, info={**self.info, "turn": j}, stop_reason=self.stop_reason,
                images=[v for v in self.images if v.at < start],
            )
            piece.token_ids.extend(self.token_ids[start:end])
            piece.loss_mask.extend(self.loss_mask[start:end])
            piece.sampling_logprobs.extend(self.sampling_logprobs[start:end])
            piece.token_versions = [-1] * start + self.token_versions[start:end]
            piece.policy_version = min(self.token_versions[start:end], default=self.policy_version)
            piece.turns.append(Turn(action=turn.action, observation=turn.observation, reward=ret, state=turn.state,
                                    sampled_start=start, sampled_end=end))
            out.append(piece)
        return out

    @property
    def response_text(self) -> str:
        return "".join(t.action for t in self.turns)
