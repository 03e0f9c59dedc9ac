"""The layer matrix: per-sample gradients of every supported layer against per-example autograd.

Each case builds a small float64 model, a batch of B examples and the per-example losses of
a batched forward. The reference gradient of example i is ``autograd.grad(losses[i])`` on
that same batched graph: exact for any model that keeps examples apart, and it sees the
forward's own dropout masks. The engine records the same forward (same RNG state) with the
batch-mean loss and must give the same per-sample norms and clipped sum (relative
tolerance 1e-6; float64). Every refusal is tested too: it must name the module, the reason
and a working alternative. docs/per_sample_gradients.md lists the layers from this file.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.privacy.clipping import clip_factors
from lightning_dp.privacy.grad_sample import GradSampleEngine, PerSampleGradientError
from tests.helpers import ACCELERATORS, DEVICE
from tests.privacy.reference import per_example_gradients

B = 5  # also the sequence length of several cases: T == B must not confuse the engine


@dataclass
class Case:
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.Generator], tuple]
    losses: Callable[[nn.Module, tuple], torch.Tensor]  # per-example losses (n,) of a batched forward
    # probe with the first n examples of one batch (what DPSGD does; the engine's probe needs it), sliced by _first
    # or, for batches that one dimension does not slice by example (flat EmbeddingBag ids with offsets), by this
    nested: bool | Callable[[tuple, int], tuple] = True
    # relative tolerance (the absolute one is this x 1e-3 of the largest value): 1e-6 unless the model itself
    # rounds somewhere (Opacus' packed recurrent layers put their final states in float32 zeros)
    tol: float = 1e-6


def _first(batch: tuple, n: int, big: int = 7) -> tuple:
    """The first ``n`` examples of a batch of ``big``: every tensor sliced along dimension 0 if it has ``big``
    entries there, else along its one dimension of size ``big`` (the sequence-first cases)."""
    out = []
    for t in batch:
        dims = [0] if t.shape[0] == big else [d for d, s in enumerate(t.shape) if s == big]
        assert len(dims) == 1, f"cannot tell the batch dimension of a tensor of shape {tuple(t.shape)}"
        out.append(t.narrow(dims[0], 0, n))
    return tuple(out)


def _first_bags(batch: tuple, n: int) -> tuple:
    """The first ``n`` bags of ``(ids, offsets, [per_sample_weights,] labels)`` (offsets of the bags' starts, with
    the end appended when ``include_last_offset``)."""
    ids, offsets, *rest, labels = batch
    last = offsets.numel() == labels.numel() + 1
    end = int(offsets[n]) if n < offsets.numel() else ids.numel()
    return (ids[:end], offsets[:n + 1] if last else offsets[:n], *(w[:end] for w in rest), labels[:n])


def _ce(logits, y):
    return F.cross_entropy(logits, y, reduction="none")


def _labels(n, g, k=3):
    return torch.randint(0, k, (n,), generator=g)


# ----------------------------------------------------------------------------------------- models
class SeqFirstLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x):  # x: (T, B, 4)
        return self.b(torch.tanh(self.a(x))).mean(0)


class Pool(nn.Module):
    def __init__(self, body: nn.Module, features: int, classes: int = 3, dims=(2, 3)):
        super().__init__()
        self.body, self.head, self.dims = body, nn.Linear(features, classes), dims

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)).mean(self.dims))


class TimeFirstPReLU(nn.Module):
    """One PReLU slope on a time-first ``(T, B, C)`` tensor (a non-batch-first RNN's or Transformer's output)."""

    def __init__(self):
        super().__init__()
        self.proj, self.act, self.head = nn.Linear(4, 5), nn.PReLU(init=0.3), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.act(self.proj(x).transpose(0, 1)).mean(0))


class CellLoop(nn.Module):
    """A recurrent cell called once a step over a ``(B, T, d)`` input, its state carried from zeros (``state``; a
    first call without state beside later calls with one is two layouts, which the engine refuses) or never passed: a
    decoder's loop; the mean of the hidden states, then a linear head."""

    def __init__(self, cell: nn.Module, state: bool = True):
        super().__init__()
        self.cell, self.head, self.state = cell, nn.Linear(cell.hidden_size, 3), state

    def forward(self, x):
        h = x.new_zeros(x.shape[0], self.cell.hidden_size)
        hx, outs = ((h, h) if isinstance(self.cell, nn.LSTMCell) else h), []
        for t in range(x.shape[1]):
            hx = self.cell(x[:, t], hx) if self.state else self.cell(x[:, t])
            outs.append(hx[0] if isinstance(hx, tuple) else hx)
        return self.head(torch.stack(outs, 1).mean(1))


class Bag(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(11, 4, **kwargs), nn.Linear(4, 3)

    def forward(self, *args, **kwargs):
        return self.head(self.bag(*args, **kwargs))


class Attention(nn.Module):
    def __init__(self, batch_first, cross=False, dropout=0.0, **kwargs):
        super().__init__()
        self.batch_first, self.cross = batch_first, cross
        self.attn = nn.MultiheadAttention(8, 2, batch_first=batch_first, dropout=dropout, **kwargs)
        self.head = nn.Linear(8, 3)

    def forward(self, x, memory=None, key_padding_mask=None, attn_mask=None):
        kv = memory if self.cross else x
        out, _ = self.attn(x, kv, kv, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        return self.head(out.mean(1 if self.batch_first else 0))


class Recurrent(nn.Module):
    def __init__(self, cell, batch_first, **kwargs):
        super().__init__()
        self.batch_first = batch_first
        self.rnn = cell(4, 5, batch_first=batch_first, **kwargs)
        dirs = 2 if kwargs.get("bidirectional") else 1
        self.head = nn.Linear(5 * dirs, 3)

    def forward(self, x, hx=None):
        out, _ = self.rnn(x, hx)
        return self.head(out[:, -1] if self.batch_first else out[-1])


class StateFromLayer(nn.Module):
    """A bidirectional LSTM or GRU whose initial states come from a trainable layer and whose loss reads only the
    final states (h_n, and the LSTM's c_n): the gradients of h0 (c0) and of the final states through the
    recurrence."""

    def __init__(self, cell):
        super().__init__()
        self.lstm = cell is nn.LSTM
        width = 20 if self.lstm else 10
        self.init, self.rnn, self.head = nn.Linear(4, width), cell(4, 5, batch_first=True, bidirectional=True), \
            nn.Linear(width, 3)

    def forward(self, x):  # (n, T, 4)
        states = torch.tanh(self.init(x[:, 0])).view(x.shape[0], -1, 5).transpose(0, 1)
        if self.lstm:
            _, (h_n, c_n) = self.rnn(x, (states[:2].contiguous(), states[2:].contiguous()))
            return self.head(torch.cat([h_n.transpose(0, 1).flatten(1), c_n.transpose(0, 1).flatten(1)], 1))
        _, h_n = self.rnn(x, states.contiguous())
        return self.head(h_n.transpose(0, 1).flatten(1))


class Packed(nn.Module):
    """A recurrent layer fed a PackedSequence of sequences of unequal lengths; the loss reads the padded output at
    each sequence's last step (batch first) and the final hidden states."""

    def __init__(self, cell, enforce_sorted, **kwargs):
        super().__init__()
        self.enforce_sorted = enforce_sorted
        self.rnn = cell(4, 5, batch_first=True, **kwargs)
        dirs = 2 if kwargs.get("bidirectional") else 1
        self.head = nn.Linear(5 * dirs + 5 * dirs * kwargs.get("num_layers", 1), 3)

    def forward(self, x, lengths, hx=None):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True,  # lengths: on the CPU
                                                   enforce_sorted=self.enforce_sorted)
        out, state = self.rnn(packed, hx)
        h = state[0] if isinstance(state, tuple) else state  # (layers * dirs, B, H)
        padded, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        last = padded[torch.arange(x.shape[0]), lengths - 1]
        return self.head(torch.cat([last, h.transpose(0, 1).reshape(x.shape[0], -1)], 1))


def _lengths(n, g, sort=False):
    lengths = torch.randint(1, B + 2, (n,), generator=g)
    return lengths.sort(descending=True).values if sort else lengths


class Tied(nn.Module):
    """An embedding whose table is also the output layer (language models tie them)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(13, 6)
        self.mix = nn.Linear(6, 6)
        self.out = nn.Linear(6, 13, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.emb(ids))))


class KeywordScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4) / 2)

    def forward(self, x, *, scale):
        return (x @ self.w) * scale[:, None]


class KeywordNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer, self.head = KeywordScale(), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.layer(x, scale=x[:, 0].sigmoid()))


class NanoLayerNorm(nn.Module):
    """nanoGPT's LayerNorm: parameters used through F.layer_norm in a custom module (torch.func rule)."""

    def __init__(self, d):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoBlock(nn.Module):
    def __init__(self, d=8, heads=2, dropout=0.1):
        super().__init__()
        self.ln_1, self.ln_2 = NanoLayerNorm(d), NanoLayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads, self.drop = heads, nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.c_proj(y))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln_2(x)))))


class NanoGPT(nn.Module):
    def __init__(self, vocab=17, t=B, d=8):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.block, self.ln_f = NanoBlock(d), NanoLayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # nanoGPT ties them

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)  # shared by every example: (T,)
        return self.lm_head(self.ln_f(self.block(self.wte(ids) + self.wpe(pos))))


def _lm_losses(logits, ids):
    """Per-example next-token loss: mean over positions."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                           reduction="none").view(ids.shape[0], -1).mean(1)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=23, n_positions=16, n_embd=8, n_layer=2, n_head=2, resid_pdrop=0.1,
                        embd_pdrop=0.1, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _gpt2_lora():
    """GPT-2 with peft LoRA adapters on every projection (with adapter dropout): only the adapters train."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=3, lora_alpha=6, lora_dropout=0.1, target_modules=["c_attn", "c_proj", "c_fc"],
                        fan_in_fan_out=True)
    model = inject_adapter_in_model(config, _gpt2())
    for name, p in model.named_parameters():  # B starts at zero: give it values so that A's gradients are not 0
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return model


def _opacus_dplstm():
    from opacus.layers import DPLSTM

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.head = DPLSTM(4, 5, batch_first=True, num_layers=2), nn.Linear(5, 3)

        def forward(self, x):
            return self.head(self.lstm(x)[0][:, -1])
    return Net()


def _opacus_packed(kind, **kwargs):
    """Opacus' DP recurrent layer in the Packed model (a PackedSequence of unequal lengths, unsorted)."""
    import opacus.layers as layers

    model = Packed(nn.LSTM, False, **kwargs)
    model.rnn = getattr(layers, kind)(4, 5, batch_first=True, **kwargs)
    return model


def _bags_with_offsets(n, g):
    lengths = torch.randint(1, 5, (n,), generator=g)
    ids = torch.randint(0, 11, (int(lengths.sum()),), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return ids, offsets


def _causal(t):
    return torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)  # True: not attended (any dtype's model)


# ----------------------------------------------------------------------------------------- cases
def _x(*shape):
    return lambda n, g: (torch.randn(n, *shape, generator=g, dtype=torch.float64), _labels(n, g))


def _simple(model, *shape):
    return Case(model, _x(*shape), lambda m, b: _ce(m(b[0]), b[1]))


CASES: dict[str, Case] = {
    "linear_2d": _simple(lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)), 4),
    "linear_3d_batch_first": _simple(lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Flatten(),
                                                           nn.Linear(6 * B, 3)), B, 4),
    "linear_sequence_first_T_eq_B": Case(SeqFirstLinear,
                                         lambda n, g: (torch.randn(B, n, 4, generator=g, dtype=torch.float64),
                                                       _labels(n, g)),
                                         lambda m, b: _ce(m(b[0]), b[1])),
    "conv1d_stride_padding_dilation_groups": _simple(
        lambda: Pool(nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2), 6, dims=(2,)), 4, 11),
    "conv2d_groups_reflect": _simple(
        lambda: Pool(nn.Conv2d(4, 6, 3, padding=1, padding_mode="reflect", groups=2), 6), 4, 7, 7),
    "conv3d_stride": _simple(lambda: Pool(nn.Conv3d(2, 3, 2, stride=2, padding=1), 3, dims=(2, 3, 4)), 2, 4, 4, 4),
    "conv2d_depthwise_nonsquare": _simple(
        lambda: Pool(nn.Conv2d(4, 8, (3, 5), stride=(2, 1), dilation=(1, 2), groups=4), 8), 4, 7, 11),
    "conv_transpose3d_groups": _simple(
        lambda: Pool(nn.ConvTranspose3d(4, 2, 2, stride=2, groups=2), 2, dims=(2, 3, 4)), 4, 3, 3, 3),
    "conv_transpose2d_stride_output_padding_groups": _simple(
        lambda: Pool(nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2), 6), 4, 5, 5),
    "conv_transpose1d_dilation": _simple(
        lambda: Pool(nn.ConvTranspose1d(3, 4, 3, stride=1, dilation=2, padding=1), 4, dims=(2,)), 3, 6),
    "embedding_padding_idx": Case(
        lambda: nn.Sequential(nn.Embedding(11, 4, padding_idx=0), nn.Flatten(), nn.Linear(4 * B, 3)),
        lambda n, g: (torch.randint(0, 11, (n, B), generator=g), _labels(n, g)),
        lambda m, b: _ce(m(b[0]), b[1])),
    "embedding_sparse_max_norm": Case(
        lambda: nn.Sequential(nn.Embedding(11, 4, max_norm=1.0, sparse=True), nn.Flatten(), nn.Linear(4 * B, 3)),
        lambda n, g: (torch.randint(0, 11, (n, B), generator=g), _labels(n, g)),
        lambda m, b: _ce(m(b[0]), b[1])),
    "embedding_bag_max_norm_l1": Case(
        lambda: Bag(mode="mean", max_norm=0.5, norm_type=1.0), lambda n, g: (torch.randint(0, 11, (n, 4), generator=g),
                                                                             _labels(n, g)),
        lambda m, b: _ce(m(b[0]), b[1])),
    "embedding_bag_sum_offsets": Case(
        lambda: Bag(mode="sum"), lambda n, g: (*_bags_with_offsets(n, g), _labels(n, g)),
        lambda m, b: _ce(m(b[0], b[1]), b[2]), nested=_first_bags),
    "embedding_bag_mean_2d_padding_idx": Case(
        lambda: Bag(mode="mean", padding_idx=0), lambda n, g: (torch.randint(0, 11, (n, 4), generator=g),
                                                               _labels(n, g)),
        lambda m, b: _ce(m(b[0]), b[1])),
    "embedding_bag_per_sample_weights_last_offset": Case(
        lambda: Bag(mode="sum", include_last_offset=True),
        lambda n, g: (*(lambda ids, off: (ids, torch.cat([off, torch.tensor([ids.numel()])]),
                                          torch.rand(ids.numel(), generator=g, dtype=torch.float64)))(
            *_bags_with_offsets(n, g)), _labels(n, g)),
        lambda m, b: _ce(m(b[0], b[1], per_sample_weights=b[2]), b[3]), nested=_first_bags),
    "layer_norm": _simple(lambda: nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3)), 4),
    "layer_norm_2d_shape_no_bias": _simple(lambda: nn.Sequential(nn.LayerNorm((3, 4), bias=False), nn.Flatten(),
                                                                  nn.Linear(12, 3)), 3, 4),
    "group_norm": _simple(lambda: Pool(nn.Sequential(nn.Conv2d(2, 6, 3), nn.GroupNorm(3, 6)), 6), 2, 6, 6),
    "instance_norm2d_affine": _simple(lambda: Pool(nn.Sequential(nn.Conv2d(2, 4, 3),
                                                                 nn.InstanceNorm2d(4, affine=True)), 4), 2, 6, 6),
    "rms_norm": _simple(lambda: nn.Sequential(nn.Linear(4, 6), nn.RMSNorm(6), nn.Linear(6, 3)), 4),
    "prelu": _simple(lambda: nn.Sequential(nn.Linear(4, 6), nn.PReLU(6), nn.Linear(6, 3)), 4),
    "prelu_one_slope_conv": _simple(lambda: Pool(nn.Sequential(nn.Conv2d(2, 4, 3), nn.PReLU(init=0.3)), 4), 2, 6, 6),
    "gru_cell_loop": _simple(lambda: CellLoop(nn.GRUCell(4, 5)), 3, 4),
    "gru_cell_without_state": _simple(lambda: CellLoop(nn.GRUCell(4, 5), state=False), 3, 4),
    "rnn_cell_tanh": _simple(lambda: CellLoop(nn.RNNCell(4, 5)), 3, 4),
    "rnn_cell_relu_no_bias": _simple(lambda: CellLoop(nn.RNNCell(4, 5, bias=False, nonlinearity="relu")), 3, 4),
    "prelu_one_slope_time_first": _simple(TimeFirstPReLU, B, 4),
    "prelu_per_channel_sequence": _simple(lambda: Pool(nn.Sequential(nn.Conv1d(2, 4, 3), nn.PReLU(4, init=0.3)), 4,
                                                       dims=(2,)), 2, 7),
    # the originals of the parametrization are the parameters (more cases: tests/privacy/test_parametrized_layers.py)
    "weight_norm_parametrized_conv": _simple(lambda: Pool(nn.utils.parametrizations.weight_norm(nn.Conv2d(2, 4, 3)),
                                                          4), 2, 6, 6),
    "mha_batch_first_key_padding_mask": Case(
        lambda: Attention(batch_first=True),
        lambda n, g: (torch.randn(n, B, 8, generator=g, dtype=torch.float64), torch.rand(n, B, generator=g) < 0.3,
                      _labels(n, g)),
        lambda m, b: _ce(m(b[0], key_padding_mask=b[1] & (torch.arange(B) > 0)), b[2])),
    "mha_sequence_first_causal_T_eq_B": Case(
        lambda: Attention(batch_first=False),
        lambda n, g: (torch.randn(B, n, 8, generator=g, dtype=torch.float64), _labels(n, g)),
        lambda m, b: _ce(m(b[0], attn_mask=_causal(B)), b[1])),
    "mha_cross_attention_kdim_vdim": Case(
        lambda: Attention(batch_first=True, cross=True, kdim=6, vdim=6),
        lambda n, g: (torch.randn(n, B, 8, generator=g, dtype=torch.float64),
                      torch.randn(n, 3, 6, generator=g, dtype=torch.float64), _labels(n, g)),
        lambda m, b: _ce(m(b[0], memory=b[1]), b[2])),
    "mha_attention_dropout": Case(
        lambda: Attention(batch_first=True, dropout=0.3),
        lambda n, g: (torch.randn(n, B, 8, generator=g, dtype=torch.float64), _labels(n, g)),
        lambda m, b: _ce(m(b[0]), b[1])),
    "transformer_encoder_layer_norm_first": Case(
        lambda: nn.Sequential(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True, norm_first=True),
                              nn.Flatten(), nn.Linear(8 * B, 3)),
        lambda n, g: (torch.randn(n, B, 8, generator=g, dtype=torch.float64), _labels(n, g)),
        lambda m, b: _ce(m(b[0]), b[1])),
    "transformer_decoder_layer_sequence_first": Case(
        lambda: nn.ModuleDict({"dec": nn.TransformerDecoderLayer(8, 2, 16, dropout=0.1), "head": nn.Linear(8, 3)}),
        lambda n, g: (torch.randn(B, n, 8, generator=g, dtype=torch.float64),
                      torch.randn(3, n, 8, generator=g, dtype=torch.float64), _labels(n, g)),
        lambda m, b: _ce(m["head"](m["dec"](b[0], b[1], tgt_mask=_causal(B)).mean(0)), b[2])),
    "lstm_two_layers_bidirectional_batch_first": Case(
        lambda: Recurrent(nn.LSTM, True, num_layers=2, bidirectional=True),
        lambda n, g: (torch.randn(n, B, 4, generator=g, dtype=torch.float64), _labels(n, g)),
        lambda m, b: _ce(m(b[0]), b[1])),
    "lstm_sequence_first_initial_state": Case(
        lambda: Recurrent(nn.LSTM, False),
        lambda n, g: (torch.randn(B, n, 4, generator=g, dtype=torch.float64),
                      torch.randn(1, n, 5, generator=g, dtype=torch.float64),
                      torch.randn(1, n, 5, generator=g, dtype=torch.float64), _labels(n, g)),
        lambda m, b: _ce(m(b[0], (b[1], b[2])), b[3])),
    "lstm_bidirectional_state_from_a_layer_final_states": Case(
        lambda: StateFromLayer(nn.LSTM),
        lambda n, g: (torch.randn(n, B, 4, generator=g, dtype=torch.float64), _labels(n, g)),
        lambda m, b: _ce(m(b[0]), b[1])),
    "gru_bidirectional_state_from_a_layer_final_state": Case(
        lambda: StateFromLayer(nn.GRU),
        lambda n, g: (torch.randn(n, B, 4, generator=g, dtype=torch.float64), _labels(n, g)),
        lambda m, b: _ce(m(b[0]), b[1])),
    "gru_bidirectional_sequence_first": Case(
        lambda: Recurrent(nn.GRU, False, bidirectional=True, num_layers=2),
        lambda n, g: (torch.randn(B, n, 4, generator=g, dtype=torch.float64), _labels(n, g)),
        lambda m, b: _ce(m(b[0]), b[1])),
    "rnn_relu_no_bias": Case(
        lambda: Recurrent(nn.RNN, True, nonlinearity="relu", bias=False),
        lambda n, g: (torch.randn(n, B, 4, generator=g, dtype=torch.float64), _labels(n, g)),
        lambda m, b: _ce(m(b[0]), b[1])),
    "lstm_packed_sorted": Case(
        lambda: Packed(nn.LSTM, True),
        lambda n, g: (torch.randn(n, B + 1, 4, generator=g, dtype=torch.float64), _lengths(n, g, sort=True),
                      _labels(n, g)),
        lambda m, b: _ce(m(b[0], b[1]), b[2])),
    "lstm_packed_unsorted_two_layers_bidirectional": Case(
        lambda: Packed(nn.LSTM, False, num_layers=2, bidirectional=True),
        lambda n, g: (torch.randn(n, B + 1, 4, generator=g, dtype=torch.float64), _lengths(n, g), _labels(n, g)),
        lambda m, b: _ce(m(b[0], b[1]), b[2])),
    "gru_packed_unsorted_initial_state": Case(
        lambda: Packed(nn.GRU, False, bidirectional=True),
        lambda n, g: (torch.randn(n, B + 1, 4, generator=g, dtype=torch.float64), _lengths(n, g),
                      torch.randn(2, n, 5, generator=g, dtype=torch.float64), _labels(n, g)),
        lambda m, b: _ce(m(b[0], b[1], b[2]), b[3])),
    "rnn_packed_unsorted": Case(
        lambda: Packed(nn.RNN, False),
        lambda n, g: (torch.randn(n, B + 1, 4, generator=g, dtype=torch.float64), _lengths(n, g), _labels(n, g)),
        lambda m, b: _ce(m(b[0], b[1]), b[2])),
    "tied_embedding_and_output": Case(
        Tied, lambda n, g: (torch.randint(0, 13, (n, B), generator=g),),
        lambda m, b: _lm_losses(m(b[0]), b[0])),
    "keyword_tensor_arguments": _simple(KeywordNet, 4),
    "nanogpt_block_wpe_tied_dropout": Case(
        NanoGPT, lambda n, g: (torch.randint(0, 17, (n, B), generator=g),), lambda m, b: _lm_losses(m(b[0]), b[0])),
}
if importlib.util.find_spec("transformers") is not None:
    CASES["hf_gpt2_tied_wpe_dropout"] = Case(
        _gpt2, lambda n, g: (torch.randint(0, 23, (n, 7), generator=g),),
        lambda m, b: _lm_losses(m(b[0]).logits, b[0]))
if importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("peft") is not None:
    CASES["hf_gpt2_lora_adapters_only"] = Case(
        _gpt2_lora, lambda n, g: (torch.randint(0, 23, (n, 7), generator=g),),
        lambda m, b: _lm_losses(m(b[0]).logits, b[0]))
if importlib.util.find_spec("opacus") is not None:
    CASES["opacus_dplstm"] = Case(
        _opacus_dplstm, lambda n, g: (torch.randn(n, B, 4, generator=g, dtype=torch.float64), _labels(n, g)),
        lambda m, b: _ce(m(b[0]), b[1]))
    for _kind, _kw in (("DPLSTM", {"num_layers": 2, "bidirectional": True}), ("DPGRU", {}), ("DPRNN", {})):
        # Opacus' packed path collects the final states in torch.zeros(B, H), float32 whatever the input's dtype
        # (opacus/layers/dp_rnn.py, DPRNNBase.forward_layer): its h_n is the recurrence rounded to float32, and the
        # reference differentiates through that; the replay is exact, so they agree to float32's precision
        CASES[f"opacus_{_kind.lower()}_packed_unsorted"] = Case(
            lambda _k=_kind, _w=_kw: _opacus_packed(_k, **_w),
            lambda n, g: (torch.randn(n, B + 1, 4, generator=g, dtype=torch.float64), _lengths(n, g), _labels(n, g)),
            lambda m, b: _ce(m(b[0], b[1]), b[2]), tol=1e-4)


def _on(batch: tuple, device: str) -> tuple:
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in batch)


def run_case(name: str, c: float = 0.5, seed: int = 0, device: str = "cpu"):
    case = CASES[name]
    torch.manual_seed(seed)
    model = case.make_model().double().train().to(device)
    g = torch.Generator().manual_seed(seed)
    batch = _on(case.make_batch(B, g), device)
    probe_g = torch.Generator().manual_seed(seed + 1)
    big = case.make_batch(7, probe_g)  # the first n examples of one batch, as DPSGD probes
    first = case.nested if callable(case.nested) else _first
    probes = {n: _on(first(big, n), device) for n in (3, 5, 7)}
    with torch.device(device):  # the losses' own tensors (masks, positions) on the device too
        return _engine_and_reference(case, model, batch, probes, c)


def _engine_and_reference(case, model, batch, probes, c):
    torch.manual_seed(1)
    params, ref = per_example_gradients(model, case.losses(model, batch))
    engine = GradSampleEngine(model)

    def run(n):  # deterministic, as the engine requires: the same batch and random draws for the same n
        with torch.random.fork_rng():
            return case.losses(model, probes[n]).mean()

    engine.probe(run)
    torch.manual_seed(1)
    with engine.record(batch_size=B):
        case.losses(model, batch).mean().backward()
    engine.check_parameter_gradients()
    norms = engine.per_sample_norms()
    summed = engine.clipped_sum(clip_factors(norms, c))
    engine.remove()
    order = {id(p): i for i, p in enumerate(engine.parameters)}
    flat = torch.cat([summed[order[id(p)]].reshape(-1) for p in params])
    return norms, flat, ref


@pytest.mark.usefixtures("exact_norms")
@pytest.mark.parametrize("name", [n for n in sorted(CASES) if n.startswith("conv")])
def test_convolutions_split_into_chunks_of_examples(name, monkeypatch):
    """The window copies a few examples at a time (as for large inputs, where one example's windows hold more than
    SCRATCH_FLOOR_ELEMENTS, or CPU_CHUNK_BYTES on a CPU): with both at 0 every convolution case runs in several
    chunks, same results."""
    from lightning_dp.privacy.grad_sample.rules import conv

    chunks = []
    original = conv._chunk
    monkeypatch.setattr(conv, "SCRATCH_FLOOR_ELEMENTS", 0)
    monkeypatch.setattr(conv, "CPU_CHUNK_BYTES", 0)
    monkeypatch.setattr(conv, "_chunk", lambda *a: chunks.append(original(*a)) or chunks[-1])
    test_layer_matrix(name, "cpu")
    assert chunks and max(chunks) == 1  # one example a chunk
    # chunks of 2 examples: the batch of B = 5 ends with a partial chunk
    monkeypatch.setattr(conv, "_chunk", lambda *a: chunks.append(min(2, original(*a))) or chunks[-1])
    monkeypatch.setattr(conv, "CPU_CHUNK_BYTES", 2**30)
    test_layer_matrix(name, "cpu")
    assert chunks[-1] == 2 and B % 2 == 1


def test_chunks_of_windows_by_device() -> None:
    """On a CPU a chunk holds about CPU_CHUNK_BYTES of windows; elsewhere about the batch's input, or
    SCRATCH_FLOOR_ELEMENTS if that is more (fewer launches on a GPU); at least one example."""
    from lightning_dp.privacy.grad_sample.rules.conv import CPU_CHUNK_BYTES, SCRATCH_FLOOR_ELEMENTS, _chunk

    patch = 64 * 196  # the MNIST CNN's first layer: 64 window entries at 196 positions per example
    assert _chunk(256, patch, 196, 4, "cpu") == CPU_CHUNK_BYTES // (patch * 4)
    assert _chunk(256, patch, 196, 8, "cpu") == CPU_CHUNK_BYTES // (patch * 8)
    assert _chunk(256, patch, 196, 4, "cuda") == SCRATCH_FLOOR_ELEMENTS // patch
    assert _chunk(10**6, patch, 196, 4, "cuda") == 10**6 * 196 // patch
    assert _chunk(1, 10**9, 1, 4, "cpu") == 1 and _chunk(1, 10**9, 1, 4, "cuda") == 1


@pytest.mark.usefixtures("exact_norms")
@pytest.mark.parametrize("gathered", [False, True], ids=["copied", "gathered"])
@pytest.mark.parametrize("layout", ["d", "t", "tc"])
@pytest.mark.parametrize("name", [n for n in sorted(CASES) if n.startswith("conv")])
def test_convolutions_in_every_layout_of_the_windows(name, layout, gathered, monkeypatch):
    """Every layout of the windows (``conv.LAYOUTS``), copied from the strided view or gathered by index, gives the
    per-example gradients of autograd, for every convolution case (groups, stride, padding modes, dilation, 1-d
    and 3-d, transposed), in one chunk and one example a chunk."""
    from lightning_dp.privacy.grad_sample.rules import conv

    used = []
    monkeypatch.setattr(conv, "_plan", lambda *a: used.append(layout) or (layout, gathered))
    test_layer_matrix(name, "cpu")
    monkeypatch.setattr(conv, "CPU_CHUNK_BYTES", 0)
    test_layer_matrix(name, "cpu")
    assert used


def test_the_layout_of_the_windows_follows_the_input() -> None:
    """:func:`conv._plan` copies the windows in the order that reads the longest contiguous stretch of the input when
    it is at least GATHER_BELOW_RUN long, else gathers them, in the order whose product gives (p, d) when p <= d
    (measured geometries, docs/benchmarks.md); other devices copy in order "d"."""
    from lightning_dp.privacy.grad_sample.rules.conv import GATHER_BELOW_RUN, _plan, _run

    def plan(shape, k, s, p, groups=1, fmt=torch.contiguous_format, dil=1):
        x = torch.zeros(shape).contiguous(memory_format=fmt)
        return _plan(x, (k, k), (s, s), (dil, dil), None, groups, p)

    assert GATHER_BELOW_RUN == 16
    assert plan((8, 1, 34, 34), 8, 2, 16) == ("t", True)  # the MNIST CNN's first layer (padded): stretches of 8
    assert plan((8, 16, 13, 13), 4, 2, 32) == ("t", True)  # its second: 4
    assert plan((8, 16, 13, 13), 4, 2, 16, groups=2) == ("t", True)
    assert plan((8, 1, 28, 28), 8, 1, 16) == ("d", False)  # the stride-1 CNN's first: rows of 21 positions
    assert plan((8, 3, 34, 34), 3, 1, 16) == ("d", False)  # ResNet-8's stem: 32
    assert plan((8, 16, 32, 32), 1, 2, 32) == ("d", True)  # its 1 x 1 stride-2 shortcut: p = 32 > d = 16
    assert plan((8, 16, 32, 32), 3, 1, 32, fmt=torch.channels_last) == ("tc", False)  # 3 x 16 channels: 48
    assert plan((8, 16, 27, 27), 4, 2, 32, dil=2) == ("t", True)  # a dilated kernel: stretches of 1
    meta = torch.empty((2, 3, 4), device="meta")
    assert _run(meta, [0, 1, 2]) == 24 and _run(meta.transpose(1, 2), [0, 1, 2]) == 1
    assert _run(meta[:, :1], [0, 1, 2]) == 4  # a dimension of size 1 does not break the stretch
    assert _plan(torch.zeros((8, 16, 13, 13), device="meta"), (4, 4), (2, 2), (1, 1), None, 1, 32) == ("d", False)


@pytest.mark.usefixtures("exact_norms")
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_layer_matrix(name, accelerator):
    """On a GPU too (float64 there as well): the engine's kernels are the device's, the reference is autograd's."""
    norms, flat, ref = run_case(name, device=DEVICE[accelerator])
    tol = CASES[name].tol
    scale = ref.norm(dim=1)
    torch.testing.assert_close(norms, scale, rtol=tol, atol=tol * 1e-3 * float(scale.max()))
    factors = clip_factors(scale, 0.5)
    expected = (factors[:, None] * ref).sum(0)
    torch.testing.assert_close(flat, expected, rtol=tol, atol=tol * 1e-3 * float(expected.abs().max()))


def test_the_floor_moves_honest_norms_little(monkeypatch):
    """What the floor on cancelling examples (``term_floor``: tests/privacy/test_cancellation.py) does to honest
    batches: over every case of the matrix and three seeds, no norm falls below autograd's, and none rises more than
    0.5 % above it (on this matrix: a convolution's bias before an InstanceNorm, a transposed convolution whose two
    channels per group are averaged over positions right after it; most cases not at all)."""
    import lightning_dp.privacy.grad_sample.contributions as contributions

    worst, floored = 0.0, 0
    for name in sorted(CASES):
        for seed in range(3):
            norms = run_case(name, seed=seed)[0]
            with monkeypatch.context() as m:
                m.setattr(contributions, "CANCELLATION_RATIO", 1e300)
                exact = run_case(name, seed=seed)[0]
            assert torch.all(norms >= exact * (1 - 1e-12)), name
            ratio = float((norms / exact.clamp_min(1e-300)).max())
            worst, floored = max(worst, ratio), floored + int((norms > exact * (1 + 1e-12)).sum())
    assert worst <= 1.005 and floored <= 3 * len(CASES) * B // 20, (worst, floored)


# -------------------------------------------------------------------------------------- refusals
REFUSALS = {
    "lstm_cell": (lambda: CellLoop(nn.LSTMCell(4, 5)), lambda m, x: m(x).sum(), r"nn.LSTMCell.*use nn.LSTM"),
    "lstm_dropout_between_layers": (lambda: nn.LSTM(4, 5, num_layers=2, dropout=0.2, batch_first=True),
                                    lambda m, x: m(x)[0].sum(),
                                    r"LSTM\(dropout=0.2\).*stack one-layer LSTMs with nn.Dropout"),
    "lstm_proj_size": (lambda: nn.LSTM(4, 5, proj_size=2, batch_first=True), lambda m, x: m(x)[0].sum(),
                       r"proj_size.*nn.Linear after the LSTM"),
    "embedding_bag_max": (lambda: nn.EmbeddingBag(11, 4, mode="max"), lambda m, x: m(x.long().abs() % 11).sum(),
                          r"mode='max'.*use mode='sum' or 'mean'"),
    "embedding_scale_grad_by_freq": (lambda: nn.Embedding(11, 4, scale_grad_by_freq=True),
                                     lambda m, x: m(x.long().abs() % 11).sum(),
                                     r"scale_grad_by_freq.*depends on the others"),
    "mha_add_bias_kv": (lambda: nn.MultiheadAttention(4, 2, add_bias_kv=True, batch_first=True),
                        lambda m, x: m(x, x, x)[0].sum(), r"add_bias_kv=True.*use add_bias_kv=False"),
    "shared_output_reduced_over_the_batch": (
        lambda: nn.Embedding(5, 4), None, r"pos \(Embedding\) receives an input without a batch dimension"),
}


class _Reduced(nn.Module):
    """A shared embedding whose output is reduced over the batch: expanding it would change the result."""

    def __init__(self):
        super().__init__()
        self.pos, self.head = nn.Embedding(5, 4), nn.Linear(4, 1)

    def forward(self, x):
        p = self.pos(torch.arange(x.shape[1]))
        return self.head(x * p.sum(0).sum())


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_refusals_name_the_module_the_reason_and_an_alternative(name):
    make, forward, match = REFUSALS[name]
    x = torch.randn(6, B, 4)
    with pytest.raises(PerSampleGradientError, match=match):
        if forward is None:
            model = _Reduced()
            engine = GradSampleEngine(model)
            engine.probe(lambda n: model(x[:n]))
            return
        model = make()
        engine = GradSampleEngine(model)
        engine.probe(lambda n: forward(model, x[:n]))
        with engine.record(batch_size=6):
            forward(model, x).backward()
        engine.per_sample_norms()


def test_the_documented_custom_rule():
    """docs/per_sample_gradients.md's example: a rule registered for a user's layer, checked like the matrix."""
    from lightning_dp.privacy.grad_sample import Dense, Factored, LayerRule, register_rule

    class ScaledLinear(nn.Module):
        def __init__(self, d_in, d_out):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
            self.scale = nn.Parameter(torch.ones(d_out) + 0.1 * torch.randn(d_out))

        def forward(self, x):
            return (x @ self.weight.T) * self.scale

    @register_rule(ScaledLinear)
    class ScaledLinearRule(LayerRule):
        def contributions(self, layer, records, batch_size):
            xs = torch.cat([r.input(0).reshape(batch_size, -1, r.input(0).shape[-1]) for r in records], 1)
            gs = torch.cat([r.grad_outputs[0].reshape(batch_size, -1, r.grad_outputs[0].shape[-1])
                            for r in records], 1)
            s = layer.module.scale.detach()
            out = {}
            if "weight" in layer.trainable:
                out["weight"] = Factored(gs * s, xs, layer.module.weight.shape)
            if "scale" in layer.trainable:
                out["scale"] = Dense((gs * (xs @ layer.module.weight.detach().T)).sum(1))
            return out

    CASES["custom_rule"] = _simple(lambda: nn.Sequential(ScaledLinear(4, 6), nn.Tanh(), nn.Linear(6, 3)), 4)
    try:
        engine = GradSampleEngine(CASES["custom_rule"].make_model())
        assert type(engine.layers[0].rule) is ScaledLinearRule
        engine.remove()
        for accelerator in ACCELERATORS:
            test_layer_matrix("custom_rule", accelerator)
    finally:
        del CASES["custom_rule"]
