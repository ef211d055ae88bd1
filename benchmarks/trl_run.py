"""TRL 1.16's GRPOTrainer as retrain's benchmarks run it (`vs_trl.py` on a CPU, `gpu.py`
on a GPU): one trainer, one configuration, so the two benchmarks compare retrain with
the same TRL, at its best and on retrain's setup:

- the settings of `../shared/gpu/trl_gpu.py`, the anchor the issue measured TRL with: a
  causal-LM PEFT model with LoRA (alpha 2 x rank, no dropout, no bias) on the seven
  projections, no gradient checkpointing, no KL term, a constant learning rate;
- one generation per optimizer step, all of a step's completions at once (TRL counts
  completions per micro-batch and generates micro-batch x steps_per_generation of them),
  trained in micro-batches of `micro` completions;
- retrain's sampling and optimizer settings: temperature 1, no top-p or top-k, AdamW
  beta2 0.99 (the quickstart template's, which both benchmarks' retrain runs start from),
  TRL's default loss ("dapo", token-level like retrain's token_mean);
- on CUDA the model in bf16 (TRL's `bf16`), on a CPU float32 with torch's threads set to
  the cores and no tokenizer thread pool beside them.

`Timing` records each optimizer step's wall time, the time inside `generate` (TRL's own
profiling reports only to wandb/mlflow/trackio), the tokens it generated, the load
average, the peak GPU memory on CUDA, and the step's mean reward from TRL's logs.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Callable

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def boxed_reward(completions, answer, **_) -> list[float]:
    """retrain's `match` reward as a TRL reward function: 1 when the last \\boxed{} of a
    completion (chat or plain) equals the answer, else 0."""
    from retrain.rewards.boxed import extract_boxed

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if extract_boxed(t) == a.strip() else 0.0 for t, a in zip(texts, answer)]


def train_trl(
    *,
    model_path: str,
    rows: list[dict],
    reward: Callable,
    group: int,
    completions: int,
    micro: int,
    max_tokens: int,
    lr: float,
    lora_rank: int,
    steps: int,
    seed: int,
    cuda: bool,
) -> list[dict]:
    """Train `steps` optimizer steps of `completions` completions (`group` per prompt of
    `rows`, TRL's dataset rows in order) and return `Timing.steps`."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if not cuda:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    accumulate = max(1, completions // micro)
    scratch = tempfile.mkdtemp(prefix="bench-trl-")
    atexit.register(shutil.rmtree, scratch, True)  # scratch: gone at exit
    args = GRPOConfig(
        output_dir=scratch,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulate,
        steps_per_generation=accumulate,
        num_generations=group,
        max_completion_length=max_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=lr,
        adam_beta2=0.99,
        lr_scheduler_type="constant",
        warmup_steps=0,
        loss_type="dapo",
        beta=0.0,
        gradient_checkpointing=False,
        use_cpu=not cuda,
        bf16=cuda,
        max_steps=steps,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    assert args.generation_batch_size == completions, args.generation_batch_size
    peft = LoraConfig(
        r=lora_rank,
        lora_alpha=2 * lora_rank,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        target_modules=PROJECTIONS,
    )
    timing = Timing(cuda)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=peft,
        callbacks=[timing.callback(TrainerCallback)],
    )
    timing.wrap_generate(trainer.model)
    trainer.train()
    return timing.steps


class Timing:
    """Per optimizer step: wall time (TRL's callbacks), time and tokens inside `generate`,
    load average, peak GPU memory (CUDA) and the mean reward TRL logs."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.steps: list[dict] = []
        self._start = 0.0
        self._generate_s = 0.0
        self._tokens = 0

    def wrap_generate(self, model) -> None:
        inner = model.generate

        def generate(*args, **kwargs):
            start = time.perf_counter()
            try:
                out = inner(*args, **kwargs)
                self._tokens += int(out.shape[0] * (out.shape[1] - kwargs["input_ids"].shape[1]))
                return out
            finally:
                self._generate_s += time.perf_counter() - start

        model.generate = generate

    def callback(self, base):
        timing = self

        class Steps(base):
            def on_step_begin(self, args, state, control, **kw):
                import torch

                timing._start = time.perf_counter()
                timing._generate_s, timing._tokens = 0.0, 0
                if timing.cuda:
                    torch.cuda.reset_peak_memory_stats()

            def on_step_end(self, args, state, control, **kw):
                import torch

                peak = torch.cuda.max_memory_allocated() / 1e9 if timing.cuda else None
                timing.steps.append(
                    {
                        "step_s": time.perf_counter() - timing._start,
                        "sampling_s": timing._generate_s,
                        "sampled_tokens": timing._tokens,
                        "peak_gpu_gb": peak,
                        "load1": os.getloadavg()[0],
                    }
                )

            def on_log(self, args, state, control, logs=None, **kw):
                if logs and "reward" in logs and timing.steps:
                    # the rewards are 1 for a correct answer, else 0
                    timing.steps[-1].update(reward=logs["reward"], correct=logs["reward"])

        return Steps()
