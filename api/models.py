"""The RLJob API (`rlkube.io/v1alpha1`): pydantic models that are the single source of truth.

The CRD in `crds/` is generated from these models (`python -m rlkube.api.crd --write`), the
operator renders Kubernetes children from them and the trainer reads the same spec, so a field
added here reaches `kubectl explain`, the API server's validation and the runtime at once.
Every field carries a description because it becomes `kubectl explain` text.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from .algorithms import (
    AdvantageEstimatorName,
    AlgorithmName,
    LossAggregationName,
    PolicyLossName,
    RolloutCorrectionMode,
    estimator_for,
    loss_aggregation_for,
    policy_loss_for,
)
from .contract import CONDITION_TYPES, PHASES, ConditionStatus, Engine, Phase, Vendor
from .platform_env import gpu_resource_name

Mode = Literal["sync", "colocate_async", "separate_async"]
Strategy = Literal["fsdp2", "megatron"]
Dtype = Literal["bfloat16", "float16", "float32"]
KlType = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"]
LrSchedule = Literal["constant", "cosine", "linear"]
WeightSyncMethod = Literal["full", "delta_sharded"]
StalePolicy = Literal["drop", "wait"]
NonFiniteReward = Literal["error", "skip"]
PullPolicy = Literal["Always", "IfNotPresent", "Never"]

# A size in bytes as a Kubernetes quantity: whole bytes, or a decimal with a k..E / Ki..Ei suffix. No
# milli-units (`1500m` is 1.5 bytes: the API server takes it, the pod gets nothing) and no bare fraction.
BYTES_PATTERN = r"^([0-9]+|[0-9]+(\.[0-9]+)?(k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei))$"
# A Kubernetes object name (DNS-1123 subdomain): ServiceAccounts, PriorityClasses, PVCs.
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A container image reference: one token, no whitespace or control characters (a newline in an image
# renders a pod the kubelet can never pull).
IMAGE_PATTERN = r"^[^\s]+$"
# Built-in reward names, or `package.module:function` for a user reward.
REWARD_PATTERN = r"^(gsm8k|math|dapo|arith|geo3k|[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*)$"
BUILTIN_REWARDS = ("gsm8k", "math", "dapo", "arith", "geo3k")
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"

# Bounds that keep CEL cost estimates within the API server's budget.
MAX_NAME = 253
MAX_PATH = 4096
MAX_ENV = 64
MAX_ITEMS = 32


class _Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are refused with their path."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
    )


class ModelSpec(_Model):
    """The policy model to post-train."""

    path: str = Field(
        min_length=1,
        max_length=MAX_PATH,
        description="Directory (inside the pods, or locally) holding the Hugging Face model: config.json, "
        "weights and tokenizer. Also the initial reference policy.",
    )
    tokenizer_path: str | None = Field(
        default=None,
        max_length=MAX_PATH,
        description="Tokenizer directory when it is not next to the weights. Default: model.path.",
    )
    max_position_embeddings: int | None = Field(
        default=None,
        ge=1,
        description="Override of config.json max_position_embeddings (Qwen2.5-Math-7B needs 32768). "
        "Must be at least data.maxPromptLength + data.maxResponseLength.",
    )
    dtype: Dtype = Field(default="bfloat16", description="Parameter dtype for training and rollout.")
    trust_remote_code: bool = Field(
        default=False,
        description="Allow model code shipped with the checkpoint (transformers trust_remote_code).",
    )
    gradient_checkpointing: bool = Field(
        default=True, description="Recompute activations in backward to save memory on long responses."
    )


class DataSpec(_Model):
    """Prompts, the reward, and length limits."""

    train: str = Field(
        min_length=1,
        max_length=MAX_PATH,
        description="Training prompts: a parquet or JSONL file (or a directory of them) readable "
        "from the pods.",
    )
    validation: str | None = Field(
        default=None,
        max_length=MAX_PATH,
        description="Validation prompts (parquet/JSONL), evaluated every training.evalIntervalSteps.",
    )
    reward: str = Field(
        pattern=REWARD_PATTERN,
        max_length=MAX_NAME,
        description="Reward function: one of gsm8k, math, dapo, arith, geo3k, or `package.module:function` "
        "importable in the image.",
    )
    max_prompt_length: int = Field(
        default=512,
        ge=1,
        description="Longest prompt in tokens; longer prompts are skipped, never cut, and counted "
        "(data/prompts_too_long_total).",
    )
    max_response_length: int = Field(default=1024, ge=1, description="Maximum generated tokens per response.")
    prompt_key: str = Field(default="prompt", max_length=MAX_NAME, description="Column holding the prompt.")
    answer_key: str = Field(
        default="answer", max_length=MAX_NAME, description="Column holding the ground truth for the reward."
    )
    image_key: str | None = Field(
        default=None,
        max_length=MAX_NAME,
        description="Column holding images for vision-language models (e.g. geo3k: images).",
    )
    shuffle: bool = Field(default=True, description="Shuffle the training prompts every epoch.")
    seed: int = Field(default=1, description="Seed of the data shuffle.")
    non_finite_reward: NonFiniteReward = Field(
        default="error",
        description="A NaN or inf reward: error stops the job naming the reward function and the "
        "sample; skip leaves the sample out of training and counts it (reward/nonfinite_total).",
    )


class OverlongBuffer(_Model):
    """DAPO overlong reward shaping: responses entering the last `length` tokens are penalised linearly."""

    enabled: bool = Field(default=True, description="Apply the penalty (present means on unless set false).")
    length: int = Field(
        default=4096, ge=1, description="Size of the soft-penalty window at the end, in tokens."
    )
    penalty_factor: float = Field(
        default=1.0, ge=0.0, description="Penalty at the hard limit (reward -factor)."
    )


class DynamicSampling(_Model):
    """DAPO dynamic sampling: drop groups whose rewards are all equal and generate more."""

    enabled: bool = Field(default=True, description="Filter zero-variance groups (present means on).")
    max_gen_batches: int = Field(
        default=10, ge=1, description="Give up filling the batch after this many generation batches per step."
    )


class KlSpec(_Model):
    """KL regularisation against the reference policy (DAPO is KL-free: leave both off)."""

    use_kl_loss: bool = Field(default=False, description="Add a KL term to the policy loss (GRPO style).")
    kl_loss_coef: float = Field(default=0.001, ge=0.0, description="Weight of the KL loss term.")
    kl_loss_type: KlType = Field(default="low_var_kl", description="KL estimator of the loss term.")
    in_reward: bool = Field(default=False, description="Subtract a KL penalty from the reward (PPO style).")
    kl_coef: float = Field(default=0.001, ge=0.0, description="Coefficient of the in-reward KL penalty.")
    kl_penalty: KlType = Field(default="kl", description="KL estimator of the in-reward penalty.")


class RolloutCorrectionSpec(_Model):
    """Importance weights between the rollout engine's log-probs and the trainer's old log-probs.

    Per token rho = pi_old / pi_rollout (the engine reports the log-prob of every token it sampled):
    corrects for the engine's numerics and, in the async modes, for stale or mixed-version samples.
    """

    mode: RolloutCorrectionMode = Field(
        default="tis",
        description="tis: weight each token's loss by min(rho, threshold) (truncated IS); mis: drop tokens "
        "with rho outside [1/threshold, threshold] from the loss and weight the rest by rho (masked IS); "
        "off. Present means tis unless set.",
    )
    threshold: float = Field(
        default=2.0, gt=1.0, le=1.0e6, description="The bound C of tis/mis (verl rollout_is_threshold)."
    )


class AlgorithmSpec(_Model):
    """The RL algorithm and its loss."""

    name: AlgorithmName = Field(
        default="grpo",
        description="grpo (group-normalised advantages), dapo (GRPO + clip-higher, dynamic sampling, "
        "overlong shaping, token-mean), or ppo (GAE with a critic). Sets the defaults of "
        "advantageEstimator and policyLoss. Immutable.",
    )
    advantage_estimator: AdvantageEstimatorName | None = Field(
        default=None,
        description="gae (with a critic), grpo (group mean/std), rloo (leave-one-out group mean) or "
        "reinforce_pp (returns whitened over the batch). Default from name: grpo/dapo -> grpo, "
        "ppo -> gae. Immutable.",
    )
    policy_loss: PolicyLossName | None = Field(
        default=None,
        description="vanilla (PPO-clip with clip-higher and dual clip), gspo (sequence-level ratio, "
        "arXiv 2507.18071) or cispo (clipped, detached IS weight on REINFORCE, arXiv 2506.13585). "
        "Default vanilla.",
    )
    group_size: int = Field(
        default=8,
        ge=1,
        le=1024,
        description="Responses sampled per prompt (rollout.n); at least 2 for the grpo and rloo estimators.",
    )
    clip_ratio_low: float = Field(default=0.2, ge=0.0, le=1.0, description="PPO clip epsilon below 1.")
    clip_ratio_high: float = Field(
        default=0.2, ge=0.0, le=10.0, description="PPO clip epsilon above 1 (DAPO clip-higher: 0.28)."
    )
    clip_ratio_c: float = Field(
        default=3.0, ge=1.0, description="Dual-clip bound for negative advantages (must be > 1)."
    )
    loss_aggregation: LossAggregationName | None = Field(
        default=None,
        description="How token losses are reduced (verl loss_agg_mode): token-mean, token-sum, "
        "seq-mean-token-sum, seq-mean-token-mean or seq-mean-token-sum-norm (Dr. GRPO). Default "
        "token-mean; seq-mean-token-mean for gspo (its only accepted value there).",
    )
    rollout_correction: RolloutCorrectionSpec | None = Field(
        default=None,
        description="Truncated or masked importance sampling between the engine's and the trainer's "
        "log-probs (verl rollout_correction); absent means off.",
    )
    overlong_buffer: OverlongBuffer | None = Field(
        default=None, description="DAPO overlong reward shaping; absent means off."
    )
    dynamic_sampling: DynamicSampling | None = Field(
        default=None, description="DAPO dynamic sampling; absent means off."
    )
    norm_adv_by_std: bool = Field(
        default=True, description="Divide group advantages by the group std (GRPO); false gives Dr.GRPO."
    )
    kl: KlSpec = Field(default_factory=KlSpec, description="KL regularisation.")
    entropy_coeff: float = Field(default=0.0, ge=0.0, description="Entropy bonus weight.")
    gamma: float = Field(default=1.0, ge=0.0, le=1.0, description="Discount factor (ppo/GAE).")
    lam: float = Field(default=1.0, ge=0.0, le=1.0, description="GAE lambda (ppo).")
    ppo_epochs: int = Field(default=1, ge=1, le=64, description="Passes over each batch per step.")
    temperature: float = Field(default=1.0, ge=0.0, description="Sampling temperature of the rollout.")
    top_p: float = Field(default=1.0, ge=0.0, le=1.0, description="Nucleus sampling top-p of the rollout.")

    @property
    def effective_advantage_estimator(self) -> str:
        """advantageEstimator, or the one `name` implies."""
        return estimator_for(self.name, self.advantage_estimator)

    @property
    def effective_policy_loss(self) -> str:
        """policyLoss, or the one `name` implies."""
        return policy_loss_for(self.name, self.policy_loss)

    @property
    def effective_loss_aggregation(self) -> str:
        """lossAggregation, or the policy loss's default."""
        return loss_aggregation_for(self.effective_policy_loss, self.loss_aggregation)

    @property
    def effective_rollout_correction(self) -> RolloutCorrectionSpec:
        """The rollout correction in force (mode off when absent)."""
        return self.rollout_correction or RolloutCorrectionSpec(mode="off")


class TrainingSpec(_Model):
    """Schedule, batch sizes and optimiser."""

    mode: Mode = Field(
        default="sync",
        description="sync: generate then train on the same GPUs. colocate_async: same GPUs, "
        "one-step-off with partial rollout. separate_async: dedicated rollout GPUs stream "
        "samples to the trainer. Immutable.",
    )
    total_steps: int = Field(default=100, ge=1, description="Optimiser steps (weight versions) to run.")
    train_batch_size: int = Field(
        default=32, ge=1, description="Prompts per training step (each yields algorithm.groupSize responses)."
    )
    mini_batch_size: int = Field(
        default=32,
        ge=1,
        description="Prompts per optimiser update (ppo_mini_batch_size); divides trainBatchSize.",
    )
    micro_batch_size: int = Field(
        default=4,
        ge=1,
        description="Sequences per GPU per forward/backward pass (gradient accumulation unit).",
    )
    micro_batch_tokens: int = Field(
        default=0,
        ge=0,
        le=1_048_576,
        description="When > 0, micro-batches are chosen by tokens instead of microBatchSize: rows of "
        "similar length are grouped so that a pass holds at most this many padded tokens (prompt + "
        "response) per GPU, each cut to its own longest row; a longer row gets a pass of its own. "
        "For varied response lengths (verl: use_dynamic_bsz with ppo_max_token_len_per_gpu). "
        "Actor, reference and critic. 0: microBatchSize sequences per pass.",
    )
    learning_rate: float = Field(default=1.0e-6, gt=0.0, le=1.0, description="Actor learning rate.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear learning-rate warmup steps.")
    lr_schedule: LrSchedule = Field(default="constant", description="Learning-rate schedule after warmup.")
    grad_clip: float = Field(default=1.0, ge=0.0, description="Max gradient norm (0 disables clipping).")
    weight_decay: float = Field(default=0.01, ge=0.0, description="AdamW weight decay.")
    seed: int = Field(default=42, description="Seed of the trainer and the rollout sampler.")
    critic_learning_rate: float = Field(
        default=1.0e-5, gt=0.0, le=1.0, description="Critic learning rate (ppo)."
    )
    eval_interval_steps: int = Field(
        default=0, ge=0, description="Evaluate on data.validation every N steps (0: never)."
    )


class TrainerSpec(_Model):
    """The training worker group."""

    replicas: int = Field(default=1, ge=1, le=1024, description="Trainer pods (Ray worker replicas).")
    gpus_per_replica: int = Field(
        default=1,
        ge=0,
        le=64,
        description="GPUs per trainer pod: one trainer rank each. With gpu.vendor cpu: CPU ranks per "
        "pod (0 counts as 1), so a CPU spec has the process layout of its GPU twin.",
    )
    strategy: Strategy = Field(
        default="fsdp2",
        description="Parallelism backend. Only fsdp2 is supported; megatron is refused for now.",
    )
    hybrid_shard: bool = Field(
        default=False,
        description="HSDP: shard the model within each trainer pod and replicate it across pods "
        "(parameter all-gathers stay inside a pod; only gradients cross pods). Needs replicas > 1.",
    )
    cpus_per_replica: int = Field(
        default=8, ge=1, le=1024, description="CPU cores per pod (also Ray num-cpus)."
    )
    memory: str = Field(default="64Gi", pattern=BYTES_PATTERN, max_length=64, description="Memory per pod.")
    shm_size: str | None = Field(
        default=None,
        pattern=BYTES_PATTERN,
        max_length=64,
        description="Size of the /dev/shm memory volume. Default: the platform default (Helm values).",
    )


class RolloutSpec(_Model):
    """The generation engine and, in separate_async, its own worker group."""

    engine: Engine = Field(
        default="vllm", description="vllm, sglang or hf (transformers generate; CPU/tests)."
    )
    replicas: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Rollout pods in separate_async. Colocated modes run one engine per "
        "tensorParallelSize trainer GPUs (all of them, or replicas x gpusPerReplica when set).",
    )
    gpus_per_replica: int | None = Field(
        default=None,
        ge=0,
        le=64,
        description="GPUs per rollout pod (gpusPerReplica / tensorParallelSize engines each); required "
        "in separate_async. Colocated modes share the trainer GPUs (default: all of them). With "
        "gpu.vendor cpu: CPU ranks per pod (unset or 0 counts as 1).",
    )
    tensor_parallel_size: int = Field(default=1, ge=1, le=64, description="GPUs per engine instance.")
    gpu_memory_utilization: float = Field(
        default=0.6,
        gt=0.0,
        le=1.0,
        description="Fraction of the device's memory the engine may take (weights, activations, KV "
        "cache). With gpu.vendor cpu (vLLM's CPU backend) it is the fraction of the node's RAM.",
    )
    kv_cache_memory: str | None = Field(
        default=None,
        pattern=BYTES_PATTERN,
        max_length=64,
        description="KV cache size per engine (e.g. 2Gi); when set it replaces gpuMemoryUtilization's "
        "sizing (vLLM kv_cache_memory_bytes), on GPUs and CPUs alike.",
    )
    max_num_seqs: int = Field(default=256, ge=1, description="Concurrent sequences per engine.")
    cpus_per_replica: int = Field(
        default=8, ge=1, le=1024, description="CPU cores per rollout pod (separate_async)."
    )
    memory: str = Field(
        default="64Gi",
        pattern=BYTES_PATTERN,
        max_length=64,
        description="Memory per rollout pod (separate_async).",
    )
    shm_size: str | None = Field(
        default=None, pattern=BYTES_PATTERN, max_length=64, description="Size of /dev/shm on rollout pods."
    )


class AsyncSpec(_Model):
    """Async RL knobs (colocate_async and separate_async only; refused in sync)."""

    staleness_threshold: float = Field(
        default=0.5,
        ge=0.0,
        le=16.0,
        description="verl's meaning: at most this fraction of each batch may come from an older "
        "policy; the rollout starts up to (1 + threshold) x trainBatchSize groups per weights "
        "version, and no group is trained more than ceil(threshold) versions after it started "
        "(0: on-policy streaming).",
    )
    parameter_sync_step: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Optimiser updates between weight pushes to the rollout; in separate_async "
        "training.trainBatchSize must equal parameterSyncStep x miniBatchSize.",
    )
    partial_rollout: bool = Field(
        default=True, description="Pause in-flight generation across a weight sync and resume it (no drop)."
    )
    stale_policy: StalePolicy = Field(
        default="drop",
        description="A straggler group that would be trained more than ceil(stalenessThreshold) "
        "versions after it started: drop it (counted in staleness/dropped_groups_total), or wait "
        "for it to finish and train it in time.",
    )


class WeightSyncSpec(_Model):
    """How new weights reach the rollout engines."""

    method: WeightSyncMethod = Field(
        default="full",
        description="full: every parameter each sync; delta_sharded: only changed values per shard.",
    )
    bucket_megabytes: int = Field(default=512, ge=1, le=65536, description="Transfer bucket size in MiB.")


class Toleration(_Model):
    """A pod toleration (the subset of core/v1 Toleration GPU taints need)."""

    key: str | None = Field(
        default=None, max_length=MAX_NAME, description="Taint key; empty with Exists matches all."
    )
    operator: Literal["Exists", "Equal"] = Field(default="Exists", description="Exists or Equal.")
    value: str | None = Field(default=None, max_length=MAX_NAME, description="Taint value for Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect; empty matches all."
    )
    toleration_seconds: int | None = Field(default=None, description="For NoExecute: how long to stay bound.")


class GpuSpec(_Model):
    """Which accelerators the workers get and where they run."""

    vendor: Vendor = Field(
        default="amd",
        description="amd (ROCm, amd.com/gpu), nvidia (CUDA, nvidia.com/gpu) or cpu (no GPUs: the demo and "
        "tests). Immutable.",
    )
    resource_name: str | None = Field(
        default=None,
        max_length=MAX_NAME,
        description="Extended resource the worker pods limit. Default: amd.com/gpu or nvidia.com/gpu. "
        "AMD partition resources such as amd.com/cpx_nps4 are allowed.",
    )
    product_name: str | None = Field(
        default=None,
        max_length=63,
        description="Pin workers to nodes labelled amd.com/gpu.product-name=<value> (vendor amd).",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_ITEMS,
        description="Extra node selector for the GPU worker pods.",
    )
    tolerations: list[Toleration] | None = Field(
        default=None,
        max_length=MAX_ITEMS,
        description="Tolerations of the worker pods. Default: tolerate the vendor's GPU taint "
        "(<resourceName>:NoSchedule). An empty list means none.",
    )


class CheckpointSpec(_Model):
    """Where and how often the trainer saves."""

    persistent_volume_claim: str | None = Field(
        default=None,
        max_length=MAX_NAME,
        pattern=DNS1123_SUBDOMAIN,
        description="PVC mounted on the trainer pods at checkpoint.path.",
    )
    interval_steps: int = Field(default=50, ge=0, description="Save every N steps (0: only at the end).")
    path: str | None = Field(
        default=None,
        max_length=MAX_PATH,
        description="Checkpoint directory. With a PVC: its mount point (default /checkpoints). Without: a "
        "local directory (default ./checkpoints/<job name>).",
    )
    keep: int = Field(default=3, ge=1, le=1000, description="Most recent checkpoints kept.")


class ResourcesSpec(_Model):
    """CPU and memory of the Ray head pod (CPU-only: it runs the driver, not the model)."""

    cpu: int | None = Field(
        default=None, ge=1, le=1024, description="CPU cores. Default: platform default (2)."
    )
    memory: str | None = Field(
        default=None,
        pattern=BYTES_PATTERN,
        max_length=64,
        description="Memory. Default: platform default (8Gi).",
    )


class EnvVar(_Model):
    """An environment variable for every Ray container; wins over rlkube's platform defaults."""

    name: str = Field(
        min_length=1, max_length=MAX_NAME, pattern=ENV_NAME_PATTERN, description="Variable name."
    )
    value: str = Field(default="", max_length=MAX_PATH, description="Value.")


class Mount(_Model):
    """A volume (models, datasets) mounted on every Ray container at the same path."""

    name: str = Field(
        min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="Volume name."
    )
    mount_path: str = Field(
        min_length=1, max_length=MAX_PATH, description="Where it appears in the containers."
    )
    persistent_volume_claim: str | None = Field(
        default=None,
        max_length=MAX_NAME,
        pattern=DNS1123_SUBDOMAIN,
        description="Claim to mount (exactly one of this and hostPath).",
    )
    host_path: str | None = Field(
        default=None,
        max_length=MAX_PATH,
        pattern=r"^/",
        description="Absolute node directory to mount (exactly one of this and the PVC). Refused unless "
        "the admin policy allows hostPath and lists the directory.",
    )
    read_only: bool = Field(default=True, description="Mount read-only.")


class RLJobSpec(_Model):
    """What to train, on what, and how: one short spec rendered into a KubeRay RayJob."""

    image: str | None = Field(
        default=None,
        max_length=MAX_PATH,
        pattern=IMAGE_PATTERN,
        description="Runtime image for head and workers (one reference, no whitespace). Default: the "
        "operator's (Helm values); the admin policy may limit registries.",
    )
    image_pull_policy: PullPolicy | None = Field(
        default=None, description="Pull policy of the runtime image."
    )
    model: ModelSpec = Field(description="The policy model.")
    data: DataSpec = Field(description="Prompts, reward and lengths.")
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description="RL algorithm and loss.")
    training: TrainingSpec = Field(default_factory=TrainingSpec, description="Schedule, batches, optimiser.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="Training worker group.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Generation engine and group.")
    async_: AsyncSpec | None = Field(
        default=None,
        alias="async",
        description="Async knobs for colocate_async / separate_async (defaults apply there); "
        "refused in sync.",
    )
    weight_sync: WeightSyncSpec = Field(
        default_factory=WeightSyncSpec, description="Weight transfer to rollout."
    )
    gpu: GpuSpec = Field(default_factory=GpuSpec, description="Accelerators and node placement.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpointing.")
    mounts: list[Mount] = Field(
        default_factory=list, max_length=MAX_ITEMS, description="Volumes with models and data, on every pod."
    )
    head: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Ray head pod resources.")
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=MAX_ENV,
        description="Env on every Ray container; overrides rlkube's platform defaults. "
        "ROCR_VISIBLE_DEVICES is refused.",
    )
    suspend: bool = Field(
        default=False,
        description="Stop the job and give the GPUs back; false resumes. Left to Kueue when the "
        "RLJob carries the kueue.x-k8s.io/queue-name label.",
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, description="Fail the job after this many seconds (RayJob activeDeadlineSeconds)."
    )
    backoff_limit: int = Field(
        default=0, ge=0, le=100, description="Retries, each on a fresh Ray cluster (RayJob backoffLimit)."
    )
    ttl_seconds_after_finished: int = Field(
        default=0, ge=0, description="Seconds the Ray cluster is kept after the job finishes (then deleted)."
    )
    priority_class_name: str | None = Field(
        default=None,
        max_length=MAX_NAME,
        pattern=DNS1123_SUBDOMAIN,
        description="PriorityClass of every pod (the admin policy lists the allowed ones).",
    )
    service_account_name: str | None = Field(
        default=None,
        max_length=MAX_NAME,
        pattern=DNS1123_SUBDOMAIN,
        description="Run pods as this ServiceAccount instead of the per-RLJob <name>-runtime one (the admin "
        "policy lists the allowed ones; it then needs patch on this RLJob's status for progress).",
    )


class Condition(_Model):
    """A standard Kubernetes condition."""

    type: str = Field(max_length=316, description=", ".join(CONDITION_TYPES) + ".")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    reason: str = Field(default="", max_length=1024, description="CamelCase reason.")
    message: str = Field(default="", max_length=32768, description="Human-readable detail.")
    last_transition_time: str | None = Field(default=None, description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(
        default=None, ge=0, description="Generation this was computed for."
    )


class Progress(_Model):
    """Training progress, pushed by the runtime through the status subresource."""

    step: int = Field(default=0, ge=0, description="Completed optimiser steps.")
    total_steps: int | None = Field(default=None, ge=0, description="training.totalSteps.")
    step_display: str | None = Field(
        default=None, max_length=64, description="'step/totalSteps' for the column."
    )
    epoch: int | None = Field(default=None, ge=0, description="Current data epoch.")
    policy_version: int | None = Field(
        default=None, ge=0, description="Weight version served by the rollout."
    )
    reward_mean: float | None = Field(default=None, description="Mean reward of the last step.")
    reward_std: float | None = Field(default=None, description="Reward std of the last step.")
    response_length_mean: float | None = Field(default=None, description="Mean response tokens, last step.")
    staleness_mean: float | None = Field(
        default=None, description="Mean sample staleness (versions), last step."
    )
    tokens_per_second: float | None = Field(
        default=None, description="Generated+trained tokens/s, last step."
    )
    step_seconds: float | None = Field(default=None, description="Wall time of the last step.")
    last_checkpoint_step: int | None = Field(default=None, ge=0, description="Step of the newest checkpoint.")
    last_update_time: str | None = Field(default=None, description="When the runtime last pushed (RFC 3339).")
    metrics: dict[str, float] = Field(
        default_factory=dict, max_length=64, description="Further scalar metrics by name."
    )


class RLJobStatus(_Model):
    """Observed state, written by the operator (and progress by the runtime)."""

    phase: Phase | None = Field(default=None, description=", ".join(PHASES) + ".")
    observed_generation: int | None = Field(
        default=None, ge=0, description="metadata.generation last acted on."
    )
    conditions: list[Condition] = Field(
        default_factory=list, max_length=32, description="Conditions by type."
    )
    ray_job_name: str | None = Field(default=None, description="The RayJob child.")
    ray_cluster_name: str | None = Field(default=None, description="The RayCluster KubeRay made for it.")
    reason: str | None = Field(default=None, description="CamelCase reason of the current phase.")
    message: str | None = Field(default=None, description="Detail of the current phase.")
    gpus: int | None = Field(
        default=None, ge=0, description="GPUs requested: trainer + rollout (the operator writes it)."
    )
    start_time: str | None = Field(default=None, description="When the job started running (RFC 3339).")
    completion_time: str | None = Field(default=None, description="When it finished (RFC 3339).")
    progress: Progress | None = Field(default=None, description="Training progress pushed by the runtime.")


class RLJob(_Model):
    """An RL post-training job (kind RLJob, rlkube.io/v1alpha1)."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["rlkube.io/v1alpha1"] = Field(
        default="rlkube.io/v1alpha1", description="rlkube.io/v1alpha1."
    )
    kind: Literal["RLJob"] = Field(default="RLJob", description="RLJob.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
    spec: RLJobSpec = Field(description="The desired job.")
    status: RLJobStatus | None = Field(default=None, description="Observed state.")

    @property
    def name(self) -> str:
        """metadata.name, or '' when loaded from a bare spec."""
        return str(self.metadata.get("name", ""))

    @property
    def namespace(self) -> str:
        """metadata.namespace, or 'default'."""
        return str(self.metadata.get("namespace") or "default")


def effective_async(spec: RLJobSpec) -> AsyncSpec:
    """The async knobs in force: the user's, or the defaults (sync mode ignores them)."""
    return spec.async_ if spec.async_ is not None else AsyncSpec()


def colocated(spec: RLJobSpec) -> bool:
    """True when trainer and rollout share GPUs (one `actor` worker group)."""
    return spec.training.mode != "separate_async"


def trainer_gpus(spec: RLJobSpec) -> int:
    """GPUs of the trainer group in total."""
    return spec.trainer.replicas * spec.trainer.gpus_per_replica


def rollout_gpus(spec: RLJobSpec) -> int:
    """GPUs the rollout engines use in total (colocated: all trainer GPUs unless set lower)."""
    if colocated(spec):
        if spec.rollout.gpus_per_replica is None:
            return trainer_gpus(spec)
        return spec.rollout.replicas * spec.rollout.gpus_per_replica
    return spec.rollout.replicas * (spec.rollout.gpus_per_replica or 0)


def total_gpus(spec: RLJobSpec) -> int:
    """GPUs the job holds: trainer GPUs when colocated, trainer + rollout in separate_async (GPUS column)."""
    if colocated(spec):
        return trainer_gpus(spec)
    return trainer_gpus(spec) + rollout_gpus(spec)


def gpu_resource(spec: RLJobSpec) -> str | None:
    """The extended resource worker pods limit, or None for vendor cpu."""
    if spec.gpu.vendor == "cpu":
        return None
    if spec.gpu.resource_name:
        return spec.gpu.resource_name
    return gpu_resource_name(spec.gpu.vendor)


def step_display(step: int, total: int | None) -> str:
    """The STEP column text, e.g. '12/400'."""
    return f"{step}/{total}" if total else str(step)


# Ray worker groups per mode, and the Ray logical resource each group's pods advertise.
COLOCATED_GROUPS = ("actor",)
SEPARATE_GROUPS = ("trainer", "rollout")


def worker_groups(spec: RLJobSpec) -> tuple[str, ...]:
    """Ray worker group names for the spec's mode: `actor`, or `trainer` + `rollout`."""
    return COLOCATED_GROUPS if colocated(spec) else SEPARATE_GROUPS


def ray_resource_name(group: str) -> str:
    """The Ray custom resource that pins actors to a worker group (e.g. rlkube_trainer)."""
    return f"rlkube_{group}"
