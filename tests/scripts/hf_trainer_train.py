#!/usr/bin/env python
"""A Hugging Face Trainer script with DeepSpeed (``--deepspeed ds.json``): a tiny GPT-2 on synthetic tokens.

An ordinary user script, knowing nothing of any orchestrator: ``HfArgumentParser`` over
``TrainingArguments`` (plus two data options), a randomly initialised ``GPT2LMHeadModel``
built locally (no download), a synthetic data set, ``Trainer(...).train(resume_from_checkpoint=...)``.

* Data: sample ``i`` is ``--seq_len`` token ids drawn from a ``torch.Generator`` seeded by
  (``--data_seed_base``, i): each sample counts up by a fixed stride modulo the vocabulary, from a
  random start, so the next token is learnable. The same on every run.
* No dropout (``*_pdrop=0``): the only randomness is the model's initialisation (``--seed``)
  and the Trainer's sampler (seeded by ``--seed``/``--data_seed``).
* Output: after every optimizer step where Trainer logs (``--logging_steps 1``), the world
  process zero prints ``step=<global step> loss=<repr of Trainer's logged loss>`` (the loss
  averaged over the processes, as Trainer logs it), from a ``TrainerCallback``.
* Checkpoints: Trainer's own, ``<output_dir>/checkpoint-<step>`` every ``--save_steps``;
  resume with ``--resume_from_checkpoint <output_dir>/checkpoint-<step>``.

Run, 2 processes on CPU (DeepSpeed's CPU accelerator; see tests/scripts/hf_ds_zero2.json)::

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 tests/scripts/hf_trainer_train.py \\
        --deepspeed tests/scripts/hf_ds_zero2.json --output_dir /tmp/hf --max_steps 40 --save_steps 10 \\
        --logging_steps 1 --per_device_train_batch_size 4 --report_to none --seed 42
    # resume: the same, plus --resume_from_checkpoint /tmp/hf/checkpoint-20
"""

import os
import sys
from dataclasses import dataclass, field

import torch
from accelerate import PartialState
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


@dataclass
class DataArguments:
    num_samples: int = field(default=1024, metadata={"help": "synthetic samples in the training set"})
    seq_len: int = field(default=32, metadata={"help": "tokens per sample"})
    vocab_size: int = field(default=128)
    data_seed_base: int = field(default=1234, metadata={"help": "seeds the synthetic samples"})


class SyntheticTokens(torch.utils.data.Dataset):
    """Deterministic sequences: sample ``i`` depends only on (base seed, i)."""

    def __init__(self, args: DataArguments):
        self.args = args

    def __len__(self):
        return self.args.num_samples

    def __getitem__(self, i):
        a = self.args
        gen = torch.Generator().manual_seed(a.data_seed_base * 1000003 + i)
        start, stride = torch.randint(0, a.vocab_size, (2,), generator=gen).tolist()
        ids = (start + (stride % 7 + 1) * torch.arange(a.seq_len)) % a.vocab_size
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


class PrintLoss(TrainerCallback):
    """Print Trainer's logged training loss, one line per logged step, on the world process zero."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            sys.stdout.write(f"step={state.global_step} loss={logs['loss']!r}\n")
            sys.stdout.flush()


def cpu_deepspeed_state():
    """CPU only: set Accelerate's state up for DeepSpeed over gloo before TrainingArguments does."""
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")


def main():
    argv = sys.argv[1:]
    if "--deepspeed" in argv and not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        cpu_deepspeed_state()
        argv += ["--accelerator_config", '{"use_configured_state": true}']
    parser = HfArgumentParser((TrainingArguments, DataArguments))
    training_args, data_args = parser.parse_args_into_dataclasses(args=argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=data_args.vocab_size,
                        n_positions=data_args.seq_len, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(training_args.seed)
    model = GPT2LMHeadModel(config)
    trainer = Trainer(model=model, args=training_args, train_dataset=SyntheticTokens(data_args),
                      callbacks=[PrintLoss()])
    st = trainer.args
    sys.stdout.write(f"setup rank={st.process_index} world_size={st.world_size} "
                     f"deepspeed={trainer.is_deepspeed_enabled} device={st.device}\n")
    sys.stdout.flush()
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    if torch.distributed.is_initialized():  # no collective may still be in flight when Python exits
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # all written, the group destroyed: skip the teardown gloo can abort (examples/ds_plain_train.py)
