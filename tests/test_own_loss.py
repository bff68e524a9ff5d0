"""Models that compute their own loss: Hugging Face transformers' GPT-2 and BERT from small configs
(no download), with labels among the inputs, through the functional step (precision, accumulation,
a masked optimizer) and through ``fit`` (dicts of tensors in memory, a Dataset of dict items)."""

from __future__ import annotations

import copy
import sys

import pytest
import ray.cloudpickle
import torch
import torch.nn.functional as F
from torch import nn

import raympi
from raympi import optim
from raympi.core.loss import default_loss
from raympi.core.state import TrainState
from raympi.core.step import make_train_step
from raympi.exceptions import TrainingError

transformers = pytest.importorskip("transformers")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module

VOCAB, SEQ = 64, 12


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )  # no dropout: the step and the torch loop draw it from other streams
    return transformers.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=SEQ, num_labels=3,
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def _decay_mask(params: dict[str, torch.Tensor]) -> dict[str, bool]:
    return {name: p.ndim >= 2 for name, p in params.items()}  # no decay on biases and norms


def _optimizer():
    return optim.chain(optim.masked(optim.add_decayed_weights(0.1), _decay_mask), optim.sgd(0.1))


def test_the_model_own_loss_is_the_default_and_equals_a_torch_loop_with_accumulation():
    """GPT-2 with labels in the batch: the step's loss and update are those of model(**batch).loss."""
    model, reference = _gpt2(), _gpt2()
    ids = _tokens(8)
    batch = {"input_ids": ids, "labels": ids}
    for accumulate in (1, 2):
        step = make_train_step(copy.deepcopy(model), default_loss, _optimizer(), accumulate=accumulate)
        state, metrics = step(TrainState.create(model, _optimizer()), batch)
        ref = copy.deepcopy(reference)
        ref.train()
        torch.manual_seed(0)
        loss = ref(**batch).loss
        assert metrics["loss"] == pytest.approx(loss.item(), rel=1e-4) and "accuracy" not in metrics
        assert metrics["samples"] == 8
        loss.backward()
        with torch.no_grad():
            for name, p in ref.named_parameters():
                decay = 0.1 * p if p.ndim >= 2 else 0.0
                expected = p - 0.1 * (p.grad + decay)
                torch.testing.assert_close(state.params[name], expected, rtol=1e-4, atol=2e-5)


def test_bert_classification_in_bf16_uses_its_own_loss():
    model = _bert()
    labels = torch.tensor([0, 1, 2, 1])
    batch = {"input_ids": _tokens(4), "attention_mask": torch.ones(4, SEQ, dtype=torch.long), "labels": labels}
    step = make_train_step(model, default_loss, optim.adam(1e-3), precision="bf16", accumulate=2)
    state = TrainState.create(model, optim.adam(1e-3))
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        first = model(**batch).loss.item()
    assert losses[0] == pytest.approx(first, rel=0.05) and losses[-1] < losses[0]


def test_no_loss_and_no_targets_says_what_to_pass():
    with pytest.raises(TrainingError, match="pass loss_fn=.*labels"):
        default_loss({"logits": torch.zeros(2, 3)}, None)
    with pytest.raises(TrainingError, match="cross-entropy of the model's output tensor"):
        default_loss({"logits": torch.zeros(2, 3)}, torch.tensor([0, 1]))
    out = torch.randn(2, 3)
    assert torch.equal(default_loss(out, torch.tensor([0, 1])), F.cross_entropy(out, torch.tensor([0, 1])))


class Texts(torch.utils.data.Dataset):
    """A map-style Dataset of dict items, as a tokenized Hugging Face dataset gives them."""

    def __init__(self, n: int) -> None:
        self.ids = _tokens(n, seed=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_fit_trains_gpt2_from_a_dict_of_tensors_and_a_dataset_of_dicts(ray_session, tmp_path):
    ids = _tokens(64)
    options = dict(workers=2, batch_size=16, epochs=2, progress=False, optimizer=_optimizer(), accumulate=2)
    result = raympi.fit(_gpt2(), {"input_ids": ids, "labels": ids}, checkpoint_dir=str(tmp_path / "a"), **options)
    losses = [r["loss"] for r in result.metrics]
    assert len(losses) == 8 and losses[-1] < losses[0] and "accuracy" not in result.metrics[0]
    texts = Texts(64)
    result = raympi.fit(
        _gpt2(), texts, eval_dataset=Texts(32), precision="bf16", checkpoint_dir=str(tmp_path / "b"), **options
    )
    assert len(result.metrics) == 8 and result.metrics[-1]["eval_loss"] < 2 * torch.log(torch.tensor(VOCAB)).item()


def test_fit_without_labels_or_loss_fn_fails_before_any_actor_starts(tmp_path):
    ids = _tokens(16)
    with pytest.raises(TrainingError, match="without a loss, and the batch has no targets"):
        raympi.fit(_gpt2(), {"input_ids": ids}, batch_size=8, progress=False, checkpoint_dir=str(tmp_path))
