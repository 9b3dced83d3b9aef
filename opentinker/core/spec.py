"""The job spec: one validated, serialisable description of an RL job.

Every section forbids unknown keys so a typo fails before any work starts, and
`load_spec` turns pydantic's errors into one line per problem: `field.path: reason`.
"""

from __future__ import annotations

import math
import re
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from opentinker.core.env_sources import check_env_field, resolve_source
from opentinker.core.ids import JOB_ID_PATTERN
from opentinker.core.model_names import context_length, folder_problem, is_resolvable
from opentinker.core.spec_limits import MAX_FIELD_CHARS, SpecError, control_problem, read_spec_file, validate_spec
from opentinker.core.spec_rules import check_placement
from opentinker.core.tool_spec import ToolSource


def storage_url(v: str) -> str:
    """An fsspec URL; a local path is made absolute (pinned to the submitter's directory, so a worker with another
    working directory writes where the user looks). Credentials come from the environment, never a URL."""
    if "://" not in v:
        v = f"file://{v}"
    scheme, rest = v.split("://", 1)
    if scheme != "file" and "@" in rest.split("/", 1)[0]:
        raise ValueError("credentials do not belong in a URL: set them in the environment (e.g. AWS_ACCESS_KEY_ID)")
    if scheme == "file" and not rest.startswith("/"):
        v = "file://" + str(Path(rest).resolve())
    return v.rstrip("/")


def _finite(v: float) -> float:
    if not math.isfinite(v):
        raise ValueError("must be finite")
    return v


LearningRate = Annotated[float, Field(gt=0), AfterValidator(_finite)]


class Section(BaseModel):
    """A spec section: unknown keys are errors, assignments are validated, and every string of it
    (names, paths, URLs, keys) is at most MAX_FIELD_CHARS long and holds no control character."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, str_max_length=MAX_FIELD_CHARS)

    @field_validator("*")
    @classmethod
    def _no_control_characters(cls, v: Any) -> Any:
        for text in ([v] if isinstance(v, str) else v if isinstance(v, list) else ()):
            if isinstance(text, str) and (problem := control_problem(text)):
                raise ValueError(problem)
        return v


class ModelSpec(Section):
    """Which base model to start from: a known name (see `opentinker.core.model_names`) or a local path."""

    name: str = Field(min_length=1, description="known model name or a local model folder")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="compute precision: auto = bfloat16 on a GPU that supports it and on a CPU with Intel AMX or AVX-512 BF16, float32 on other CPUs "
        "(trained weights and the optimizer stay float32; see opentinker/backend/device.py)")
    init_from: str | None = Field(
        None, description="start from a trained policy instead of the bare base model: a checkpoint URL "
        "(a step folder, or a job folder for its latest complete step) or a registry URI models:/<name>@<alias> | models:/<name>/<version>; "
        "its weights (adapter merged) become this job's base and KL reference")

    @field_validator("init_from")
    @classmethod
    def _checkpoint_or_registry(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if v.startswith("models:/"):
            if not re.fullmatch(r"models:/[^/@]+(@[A-Za-z0-9_-]+|/\d+)", v):
                raise ValueError("a registry URI looks like models:/<name>@<alias> or models:/<name>/<version>")
            return v
        return storage_url(v)

    @field_validator("name")
    @classmethod
    def _resolvable(cls, name: str) -> str:
        if not is_resolvable(name):
            raise ValueError(folder_problem(name) or f"unknown model {name!r}: not a known name nor an existing local folder")
        if problem := folder_problem(name):
            raise ValueError(problem)
        return name


class _AdapterBase(Section):
    """What LoRA and full training share: a vision-language model's vision side may learn at its own rate."""

    vision_lr: float | None = Field(None, gt=0, description="learning rate of the vision side that trains (connector, "
                                                           "encoder); default: optimization.lr")

    @model_validator(mode="after")
    def _vision_lr_needs_training(self):
        if self.vision_lr is not None and self.vision_tower == "frozen":
            raise ValueError("vision_lr is set but vision_tower is frozen: nothing of the vision side trains (use connector or trainable)")
        return self


class LoraSpec(_AdapterBase):
    kind: Literal["lora"] = Field("lora", description="lora: train low-rank adapters on the frozen base")
    r: int = Field(16, gt=0, description="LoRA rank: the inner width of each B·A update")
    alpha: float = Field(32.0, gt=0, description="LoRA scale numerator: updates are scaled by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA input during training (0: none)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1, description="projections of the language model that get LoRA (a VLM's vision encoder never does)")
    vision_tower: Literal["frozen", "connector", "trainable"] = Field(
        "frozen", description="vision-language models: beside the LoRA, train nothing of the vision side, only the "
                              "connector (the projection into the language model), or the vision encoder and connector")


class FullSpec(_AdapterBase):
    kind: Literal["full"] = Field("full", description="full: train every weight of the model")
    vision_tower: Literal["frozen", "connector", "trainable"] = Field(
        "trainable", description="vision-language models: train the vision encoder and connector too, only the connector, "
                                 "or keep both frozen")


AdapterSpec = Annotated[Union[LoraSpec, FullSpec], Field(discriminator="kind")]


class KLSpec(Section):
    coef: float = Field(0.0, ge=0, description="weight of the per-token KL(policy || base) term added to the loss (0: none)")
    estimator: Literal["k1", "k3"] = Field("k3", description="per-token KL estimator with r = p_base / p_policy: k1 = -log r, k3 = r - 1 - log r (unbiased, non-negative)")


class AlgorithmSpec(Section):
    advantage: Literal["grpo", "rloo", "grpo_per_step", "gigpo", "gae"] = Field("grpo", description="grpo: reward minus the group mean; rloo: "
        "minus the mean of the group's other samples; grpo_per_step: each turn its return from there on, against the group's whole returns; "
        "gigpo: GRPO plus each turn's return against the turns that acted from the same state; gae: GAE over the turns, from a critic")
    gamma: float = Field(1.0, ge=0, le=1, description="grpo_per_step, gigpo, gae: the discount of later turns' rewards in a turn's return")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="gae: lambda (1: return minus value; 0: one-step temporal difference)")
    critic_lr: float = Field(1e-4, gt=0, description="gae: the critic's AdamW learning rate (its own LoRA and value head: backend/critic.py)")
    critic_epochs: int = Field(2, gt=0, le=64, description="gae: passes of the critic over each step's turns")
    value_clip: float = Field(0.2, gt=0, description="gae: PPO's value clip around the values the advantages were computed with")
    step_weight: float = Field(1.0, ge=0, description="gigpo: the weight of the step-level advantage beside the episode's")
    normalize_std: bool = Field(True, description="GRPO: divide by the group's reward std")
    clip_range: float = Field(0.2, gt=0, lt=1, description="PPO clip: the importance ratio is clipped to [1 - clip_range, 1 + clip_range]")
    kl: KLSpec = Field(default_factory=KLSpec, description="KL penalty to the base model (LoRA: the base is the adapter switched off)")
    loss_aggregation: Literal["token-mean", "seq-mean"] = Field("token-mean", description="token-mean: each sampled token weighs the same; seq-mean: each sequence")
    max_staleness: int = Field(0, ge=0, le=64, description="k: every trained token was drawn by a policy at most k versions older "
                               "(0: synchronous; k > 0: a producer plays up to k steps ahead while the trainer updates; decoupled PPO)")
    importance_cap: float = Field(2.0, ge=1.0, description="k > 0: the cap C of each token's weight min(pi_prox / pi_behaviour, C)")


class RolloutSpec(Section):
    prompts_per_step: int = Field(8, gt=0, le=4096, description="tasks drawn per optimizer step")
    group_size: int = Field(4, gt=0, le=1024, description="episodes played per task; advantages compare within the group")
    max_new_tokens: int = Field(24, gt=0, le=32768, description="tokens the policy may generate per turn")
    temperature: float = Field(1.0, gt=0, description="sampling temperature; the trainer scores the same softmax(logits / T)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (1: off); the recorded logprobs are those of the truncated distribution")
    max_turns: int = Field(1, gt=0, le=10000, description="policy turns per episode (1: single-turn)")
    max_total_tokens: int = Field(1024, gt=0, le=1_048_576, description="tokens of a whole episode (prompt, turns, observations); past it the episode ends")
    step_timeout_s: float = Field(10.0, gt=0, description="an environment call slower than this fails its episode")
    prefix_cache_tokens: int = Field(65536, ge=0, description="multi-turn episodes reuse the key/values of their record so far "
                                     "up to this many tokens in all (memory: ≈46 KB a token for SmolLM2-135M); 0 turns it off")
    engine: Literal["auto", "local", "server", "vllm"] = Field("auto", description="auto: vllm where the worker can run it and the job "
        "(a LoRA job on a base of its own, single-agent, a text model vLLM takes), else local, decided on the worker and logged; "
        "local: transformers generation in the job's process; vllm: a vLLM server the job starts (CPU or GPU) taking the policy's "
        "weights after every update; server: an OpenAI-compatible server taking its LoRA adapter")
    weight_sync: Literal["auto", "merged", "lora"] = Field("auto", description="engine 'vllm': merged: the policy's weights loaded by the server in "
        "place (a LoRA's factors merged into its base, a full fine-tune's weights as they are); lora (LoRA jobs): the adapter by name (vLLM's "
        "LoRA path: 3.3x slower to decode on a CPU); auto: merged on a CPU and for full fine-tunes, lora for a LoRA on a GPU")
    sampler_dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="engine 'vllm' (or 'auto' choosing it): the precision its server samples in "
        "(auto: the job's compute precision). bfloat16 under a float32 trainer samples faster and its tokens' logprobs differ from the "
        "trainer's (SmolLM2: 0.03 on average): the loss then weighs each token by decoupled PPO's capped pi_trainer / pi_sampler")
    servers: int = Field(1, gt=0, le=64, description="the job's own inference servers (on GPUs one per tensor_parallel devices, on a CPU "
                         "sharing its cores): each request goes to the one with the fewest in flight; every one takes and verifies each update")
    tensor_parallel: int = Field(1, gt=0, le=64, description="GPUs each of the job's vLLM servers spans (vLLM's --tensor-parallel-size), for a "
                                 "model one device cannot hold")
    server_url: str | None = Field(None, description="engine 'server': a running server to sample through (reading the job's adapters from this disk)")
    sync_tolerance: float | None = Field(None, gt=0, description="engines 'server' and 'vllm': largest mean |logprob difference| between the server "
                                         "and the trainer on the sync probe; None: 1e-3 in float32, 0.1 in bfloat16/float16")

    @field_validator("server_url")
    @classmethod
    def _http(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"{v!r} must start with http:// or https://")
        return v


class OptimizationSpec(Section):
    lr: LearningRate = Field(1e-4, description="AdamW learning rate")
    steps: int = Field(10, gt=0, le=1_000_000, description="optimizer steps (a million at most: a budget beyond is a typo)")
    grad_clip: float = Field(1.0, gt=0, description="gradients are clipped to this global norm")
    micro_batch_size: int = Field(8, gt=0, description="sequences per forward/backward; gradients accumulate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    shared_prefix: bool | Literal["auto"] = Field("auto", description="a group's common prompt (its records' longest common token prefix) runs "
        "once per update and the samples' completions against it, with the same loss and gradients; false: every record runs whole (vision-language "
        "models and sharded trainers always do); auto: on the CPU, off on a GPU (whole records in large micro-batches ran 1.8x faster there: "
        "bench/results/gpu_variants_full.md)")
    compile: bool = Field(False, description="torch.compile each decoder layer's MLP and norms (opentinker/backend/regional_compile.py): "
                          "for GPUs, where the update of the 1.5B shape ran 1.13x faster; the first update and rollout pay the "
                          "compile (seconds); not with resources.share_base")


class HealthSpec(Section):
    """When failed episodes (an environment that raises, hangs, returns garbage, a NaN reward, a
    server that does not answer) stop the job instead of quietly training on nothing."""

    max_failure_rate: float = Field(0.5, ge=0, le=1, description="a step (or an evaluation) with more failed episodes is unhealthy")
    unhealthy_steps: int = Field(3, gt=0, description="the job fails after this many unhealthy steps in a row")


class EvaluationSpec(Section):
    every: int = Field(5, ge=0, description="evaluate every k steps (0: only before and after training)")
    greedy: bool = Field(True, description="evaluate with greedy decoding (false: sample as in training)")
    n_samples: int = Field(64, gt=0, le=100_000, description="validation problems per evaluation")


class CheckpointLocation(Section):
    base_url: str = Field("file://./runs", description="fsspec URL; checkpoints go to <base_url>/<job_id>/ (default: storage.base_url)")

    @field_validator("base_url")
    @classmethod
    def _absolute_local(cls, v: str) -> str:
        return storage_url(v)


class CheckpointSpec(CheckpointLocation):
    every: int = Field(1, ge=0, description="checkpoint every k steps (0: only at the end); flows log a step's metrics once it is checkpointed")
    keep_last: int = Field(2, gt=0, description="complete checkpoints kept; older ones are deleted")


class StorageSpec(Section):
    """Where a job's files go: checkpoints (unless checkpoint.base_url says otherwise),
    transcripts and inference outputs, under <base_url>/<job_id>/. `file://…` or `s3://bucket/prefix`."""

    base_url: str = Field("file://./runs", validate_default=True, description="fsspec URL (file://, s3://); credentials come from the environment")

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        return storage_url(v)


class MultiAgentSpec(Section):
    """Self-play for games with several players (the env's game is a match, e.g. GomokuMatch)."""

    players: list[str] = Field(default_factory=lambda: ["X", "O"], min_length=2, description="the match's player names, in turn order")
    opponent: Literal["agents", "self", "snapshot"] = Field(
        "agents", description="agents: every player its own policy, all trained; self: one policy plays and learns every seat; "
        "snapshot: the first player learns against a frozen copy of itself, refreshed every snapshot_every steps")
    snapshot_every: int = Field(5, gt=0, description="opponent 'snapshot': a frozen copy of the learner is taken every k steps")
    phase_timeout_s: float = Field(3600.0, gt=0, description="a phase (rollout or update) that runs longer fails with the agent named")


class ResourcesSpec(Section):
    """What the job's actors ask the Ray cluster for."""

    num_gpus: float = Field(0, ge=0, description="GPUs for the trainer (and the rollout engine when colocated)")
    num_cpus: float = Field(1, gt=0, description="logical CPUs reserved per actor; torch threads are set separately")
    torch_threads: int = Field(0, ge=0, description="torch threads per actor (0: all cores of the node)")
    colocate: bool = Field(True, description="trainer and rollout engine in one process sharing one model copy")
    share_base: bool = Field(False, description="a LoRA job trains as an adapter of its pool's base-model worker: one copy of "
                             "the base for many jobs and Tinker sessions, their episodes sampled in shared batches")
    trainer_ranks: int = Field(1, ge=1, le=64, description="processes the trainer is sharded over (FSDP2; num_cpus and 1/N of the model state each)")
    trainer_placement: Literal["pack", "spread"] = Field("pack", description="the ranks on as few nodes as fit (pack) or on different nodes where they can (spread)")


# `register` is the field's name in the interface other modules use; it shadows only the ABC
# metaclass's `register`, which nothing calls on a spec section.
warnings.filterwarnings("ignore", message='Field name "register" in "RegistrySpec" shadows', category=UserWarning)


class RegistrySpec(Section):
    """Where a completed job's final checkpoint is registered (MLflow model registry, see
    opentinker/storage/registry.py): a new version of `model_name` with lineage tags and alias `challenger`."""

    model_name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$",
        description="registered model name; None: '<tenant or project>-<game class in lower case>' "
        "(e.g. default-uppercasegame; 'env' for a served environment)")
    register: bool = Field(True, description="register the final checkpoint when the job completes")


class EnvSpec(Section):
    """Where episodes are played. Exactly one of: a shipped game class imported on the worker (`game`,
    or `source`: a collection the service adapts, e.g. reasoning_gym and its `dataset`), a served environment
    (`url`, see `opentinker env serve`), or a game in the user's own process reached through the client link
    (`link`: the game's name; `ServiceClient.fit` sets it when it hosts the game). Checks: core/env_sources.py."""

    game: str | None = Field(None, description="import path of an AbstractGame subclass, 'package.module:ClassName'")
    url: str | list[str] | None = Field(None, description="base URL of a served environment, or a list of shards")
    protocol: Literal["opentinker", "openenv"] = Field("opentinker", description="env.url: what its servers speak: ours "
                                                       "(opentinker env serve) or OpenEnv's (openenv-core's /ws and /schema)")
    link: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_.]{0,99}$", description="name of a game hosted by the client through the gateway")
    source: Literal["reasoning_gym"] | None = Field(None, description="a collection the service adapts (its game becomes env.game): reasoning_gym")
    dataset: str | dict[str, Any] | None = Field(None, validate_default=True, description="env.source: a dataset's name, or a weighted mix {name: weight or {weight, config}}")
    timeout_s: float = Field(30.0, gt=0, description="env.url / env.link: seconds per call")
    retries: int = Field(2, ge=0, description="env.url: retries of a request that did not get through (a step that was sent is never re-sent)")
    link_timeout_s: float = Field(300.0, gt=0, description="env.link: how long the job waits for its client to (re)connect before it fails")
    config: dict[str, Any] = Field(default_factory=dict, description="keyword arguments for the game's data source")
    tools: list[ToolSource] = Field(default_factory=list, max_length=16, description="tools every episode may call beside its game's: [{mcp: URL}, {python: {limits}}] (core/tool_spec.py)")
    tool_calls_per_turn: int = Field(4, ge=1, le=64, description="tool calls answered in one turn; more are answered with an error")

    @model_validator(mode="before")
    @classmethod
    def _source_is_a_game(cls, data: Any) -> Any:
        return resolve_source(data)

    @field_validator("game", "url", "source", "dataset", "config")
    @classmethod
    def _checked(cls, v: Any, info: ValidationInfo) -> Any:
        return check_env_field(info.field_name, v, info.data)

    @model_validator(mode="after")
    def _one_source(self) -> EnvSpec:
        if sum(x is not None for x in (self.game, self.url, self.link)) != 1:
            raise ValueError("give exactly one of env.game (a shipped game run on the worker), env.url (a served "
                             "environment) or env.link (a game in your process, set by ServiceClient.fit)")
        if self.protocol != "opentinker" and self.url is None:
            raise ValueError(f"env.protocol {self.protocol!r} says how env.url's servers are spoken to: give it with env.url")
        return self

    @property
    def urls(self) -> list[str]:  # the shards of a served environment (empty otherwise)
        return [self.url] if isinstance(self.url, str) else list(self.url or [])

    @property
    def label(self) -> str:  # what to show for this environment: the import path, the URL(s) or the linked game
        return self.game or (f"link:{self.link}" if self.link else ", ".join(self.urls))


class BaseJobSpec(Section):
    """The sections every job kind shares (RL here, SFT in opentinker.sft.spec): who it is, which model and
    adapter it trains, where its files go, what it asks the cluster for, how its final checkpoint is registered."""

    job_id: str | None = Field(None, pattern=rf"^{JOB_ID_PATTERN}$", description="the job's name; resubmitting it resumes from its last checkpoint (default: generated)")
    model: ModelSpec = Field(description="the base model")
    adapter: AdapterSpec = Field(default_factory=LoraSpec, description="what trains: a LoRA adapter or every weight")
    checkpoint: CheckpointLocation = Field(default_factory=CheckpointLocation, description="where checkpoints go")
    storage: StorageSpec = Field(default_factory=StorageSpec, description="where the job's files go")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="what the job asks the cluster for")
    registry: RegistrySpec = Field(default_factory=RegistrySpec, description="how the final checkpoint is registered in MLflow")

    @model_validator(mode="after")
    def _checkpoints_follow_storage(self) -> "BaseJobSpec":
        """checkpoint.base_url defaults to storage.base_url: one setting moves a job to S3."""
        if "base_url" not in self.checkpoint.model_fields_set and self.checkpoint.base_url != self.storage.base_url:
            self.checkpoint = self.checkpoint.model_copy(update={"base_url": self.storage.base_url})
        return self


class JobSpec(BaseJobSpec):
    """An RL job: the shared sections plus the algorithm, rollouts, optimisation, evaluation and
    environment (and `multiagent` for self-play)."""

    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description="advantages, clipping, KL and loss aggregation")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="how episodes are sampled")
    optimization: OptimizationSpec = Field(default_factory=OptimizationSpec, description="the optimizer and the step budget")
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec, description="held-out evaluation during training")
    health: HealthSpec = Field(default_factory=HealthSpec, description="when failing episodes fail the job")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="where and how often checkpoints are written")
    env: EnvSpec = Field(description="where episodes are played: a game class, a served environment or the client's link")
    multiagent: MultiAgentSpec | None = Field(None, description="self-play: players, opponents and credit (none: single agent)")
    seed: int = Field(0, description="seeds task order, adapter init and sampling")

    def evaluates_at(self, done: int) -> bool:
        """Evaluate after `done` steps: every k steps and always after the last one."""
        every = self.evaluation.every
        return done == self.optimization.steps or (every > 0 and done % every == 0)

    def checkpoints_at(self, done: int) -> bool:
        """Checkpoint after `done` steps: every k steps and always after the last one."""
        every = self.checkpoint.every
        return done == self.optimization.steps or (every > 0 and done % every == 0)

    @model_validator(mode="after")
    def _placement_fits_the_job(self) -> "JobSpec":
        check_placement(self)  # the rules between sections, in a module of their own
        return self

    @model_validator(mode="after")
    def _episodes_fit_the_model(self) -> "JobSpec":  # here, not 18 s in: vLLM refuses a longer --max-model-len at its start
        if (context := context_length(self.model.name)) is not None and self.rollout.max_total_tokens > context:
            raise ValueError(f"rollout.max_total_tokens: {self.rollout.max_total_tokens} is more than the {context} tokens "
                             f"{self.model.name} takes (its max_position_embeddings); make it at most {context}")
        if self.rollout.group_size < 2:  # the group baseline needs a group
            raise ValueError(f"rollout.group_size: {self.algorithm.advantage} compares samples within a group, "
                             f"so group_size must be at least 2 (got {self.rollout.group_size})")
        return self


read_spec_yaml = read_spec_file  # a spec file's YAML, read within the limits of core.spec_limits (SpecError in one line)


def parse_spec(data: dict[str, Any]) -> JobSpec:
    """Validate a plain dict (e.g. from YAML or a client) into a JobSpec, or raise SpecError."""
    return validate_spec(JobSpec, data)


def load_spec(path: str | Path) -> JobSpec:
    """Read a YAML job spec from disk and validate it."""
    return parse_spec(read_spec_yaml(path))


def dump_spec(spec: BaseModel) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)
