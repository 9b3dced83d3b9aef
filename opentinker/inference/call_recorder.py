"""What an endpoint that trains the user's own agent keeps of every call it answers (the third door).

The harness names its episode in a header (`X-OpenTinker-Episode`, an id the job gave it with
`open`); each chat call it makes is recorded as the tokens the server rendered and sampled
(opentinker.agent.call_join.RecordedCall: prompt ids, sampled ids, their logprobs, the policy
version, the template's hash), never as text. `close` hands the episode's calls to the job, which
joins them into records (call_join).

Bounded, because the harness is the tenant's code: episodes open at once, calls in an episode,
tokens in a call. A call past a bound gets a clear error and fails its episode (kept as the
episode's failure, counted by the job, the later calls refused), never the endpoint or the job. A
call naming no episode, or one never opened, is refused before anything is sampled.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from dataclasses import dataclass, field

from opentinker.agent.call_join import RecordedCall
from opentinker.backend.sequences import Completion

EPISODE_HEADER = "X-OpenTinker-Episode"


class RecordingRefused(Exception):
    """A call the recorder will not answer: `status` is the HTTP status, the message says why."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RecordLimits:
    episodes_in_flight: int = 256
    calls_per_episode: int = 64
    tokens_per_call: int = 16384  # the rendered prompt and the completion it asks for (`max_tokens`) together


@dataclass
class EpisodeCalls:
    """One episode's calls in the order they were answered, and why it failed (None: it did not)."""

    calls: list[RecordedCall] = field(default_factory=list)
    failure: str | None = None


def template_hash(tokenizer, tool_format: str = "") -> str:
    """Which rendering made a call's prompt: the chat template and the tool format, hashed."""
    text = f"{getattr(tokenizer, 'chat_template', None) or ''}\0{tool_format}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class CallRecorder:
    def __init__(self, template: str, limits: RecordLimits = RecordLimits()):
        self.template, self.limits = template, limits
        self._episodes: dict[str, EpisodeCalls] = {}
        self._lock = threading.Lock()

    def open(self) -> str:
        """A new episode's id, for the harness's header."""
        with self._lock:
            if len(self._episodes) >= self.limits.episodes_in_flight:
                raise RecordingRefused(429, f"at most {self.limits.episodes_in_flight} episodes in flight")
            episode = secrets.token_urlsafe(16)
            self._episodes[episode] = EpisodeCalls()
            return episode

    def admit(self, episode: str | None, prompt_tokens: int, budget: int) -> None:  # budget: max_tokens asked (0: none)
        """Before a call samples: its episode is open and has not failed, and the call is within
        bounds (else the episode fails, and this and its later calls are refused)."""
        with self._lock:
            calls = self._episodes.get(episode or "")
            if calls is None:
                raise RecordingRefused(400 if not episode else 404, f"{EPISODE_HEADER}: " + (
                    "this endpoint records episodes: name the call's episode in the header" if not episode
                    else "no such episode is open"))
            if calls.failure is None and len(calls.calls) >= self.limits.calls_per_episode:
                calls.failure = f"more than {self.limits.calls_per_episode} calls in the episode"
            elif calls.failure is None and prompt_tokens + budget > self.limits.tokens_per_call:
                calls.failure = (f"a call of {prompt_tokens} prompt tokens and {budget} to sample is over "
                                 f"{self.limits.tokens_per_call} tokens a call")
            if calls.failure is not None:
                raise RecordingRefused(400, f"the episode failed: {calls.failure}")

    def record(self, episode: str, prompt_ids: list[int], completion: Completion, text: str) -> None:
        """One answered call (one choice of it): its tokens as rendered and sampled."""
        version = min(completion.versions, default=0)
        call = RecordedCall(list(prompt_ids), list(completion.token_ids), [float(x) for x in completion.logprobs],
                            version, self.template, text)
        with self._lock:
            calls = self._episodes.get(episode)
            if calls is not None and calls.failure is None and len(calls.calls) < self.limits.calls_per_episode:
                calls.calls.append(call)  # (calls admitted together may not all fit)

    def fail(self, episode: str, why: str) -> None:
        """The episode is lost (the harness raised, hung or sent garbage): later calls are refused."""
        with self._lock:
            calls = self._episodes.get(episode)
            if calls is not None and calls.failure is None:
                calls.failure = why

    def close(self, episode: str) -> EpisodeCalls:
        """The episode's calls, handed over once; its id is refused from now on."""
        with self._lock:
            calls = self._episodes.pop(episode, None)
        if calls is None:
            raise KeyError(f"no such episode is open: {episode}")
        return calls
