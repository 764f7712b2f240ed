"""The conformance zoo: small models of many architectures, each with its inputs and a scalar loss.

Why here (the runtime's package, not tests/): the zoo command (`benchmarks/zoo.py`) and the
test suite (tests/test_zoo.py, tests/test_replay_exact.py) run the same models, and a user checking
a runtime change against architectures the project has no preset for imports them the same way.
Hugging Face models are built from their config classes at tiny shapes with seeded random weights
(no download; transformers is imported only by the factories that need it); the plain `nn.Module`s
carry what HF models rarely do: BatchNorm running statistics, weight tying, a buffer mutated in
forward, in-place writes after a producer and uninitialised memory filled by an index write (the
cases of issue 39: `scores /= 4.0`, Mixtral's `inv_perm = empty_like(perm); inv_perm[perm] = ...`).

Each factory returns a `Workload` (`slackswap.runtime.training_workload`): a module called with one
tensor (an HF model is wrapped so that its outputs are one logits tensor), the batch, and a loss of
that output (cross entropy against the batch's own tokens, or fixed labels for images).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from slackswap.runtime.training_workload import Workload, token_loss

VOCAB, HIDDEN, LAYERS, HEADS, SEQ, BATCH = 64, 64, 2, 4, 64, 2
#: Depth of the plain modules: at two layers their activations are no larger than the loss's logits,
#: and no budget below the keep-all peak could be met by any plan of the layers.
PLAIN_LAYERS = 4


class _Logits(nn.Module):
    """An HF model called with one tensor, returning its logits (`call` builds the keyword arguments)."""

    def __init__(self, model: nn.Module, call: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self._call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._call(self.model, x)


def _tokens(seed: int, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(seed))


def _hf(config_name: str, auto: str = "AutoModelForCausalLM", call=None, seq: int = SEQ,
        **config: object) -> Callable[[int], Workload]:
    def build(seed: int) -> Workload:
        import transformers

        cfg = getattr(transformers, config_name)(**config)
        cfg.use_cache = False  # a recomputed layer must not append to a key/value cache again
        torch.manual_seed(seed)
        model = getattr(transformers, auto).from_config(cfg, attn_implementation="eager")
        model.train()
        batch = _tokens(seed, seq)
        net = _Logits(model, call or (lambda m, x: m(input_ids=x).logits))
        return Workload(config_name.removesuffix("Config").lower(), net, batch, token_loss(batch), VOCAB)

    return build


_DEC = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": HEADS // 2, "max_position_embeddings": 64,
        "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
_ENC = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "max_position_embeddings": 64, "pad_token_id": 0}


def _mlm(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(input_ids=x).logits


def _seq2seq(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(input_ids=x, decoder_input_ids=x).logits


def _vit(seed: int) -> Workload:
    import transformers

    cfg = transformers.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                                 intermediate_size=2 * HIDDEN, image_size=32, patch_size=4, num_labels=8)
    torch.manual_seed(seed)
    model = transformers.ViTForImageClassification(cfg)
    model.train()
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(BATCH, 3, 32, 32, generator=gen)
    labels = torch.randint(0, 8, (BATCH,), generator=gen)
    net = _Logits(model, lambda m, x: m(pixel_values=x).logits)
    return Workload("vit", net, images, lambda out: nn.functional.cross_entropy(out, labels), 8)



def _hf_input(config_name: str, model_name: str, draw: Callable[[torch.Generator], torch.Tensor], call,
              **config: object) -> Callable[[int], Workload]:
    """A Hugging Face model of another input (images, audio, long text) whose forward's last hidden state is
    scored by its mean square: `draw` makes the input from the seed's generator."""

    def build(seed: int) -> Workload:
        import transformers

        cfg = getattr(transformers, config_name)(**config)
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(cfg)
        model.train()
        batch = draw(torch.Generator().manual_seed(seed))
        net = _Logits(model, call)
        return Workload(config_name.removesuffix("Config").lower(), net, batch, lambda out: out.square().mean(), 8)

    return build


def _images(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(BATCH, 3, 32, 32, generator=gen)


def _waves(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(BATCH, 1600, generator=gen)


def _text(seq: int) -> Callable[[torch.Generator], torch.Tensor]:
    return lambda gen: torch.randint(2, VOCAB, (BATCH, seq), generator=gen)


def _ids(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(input_ids=x).last_hidden_state


def _pixels(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(pixel_values=x).last_hidden_state


def _audio_values(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(input_values=x).last_hidden_state


def _whisper(seed: int) -> Workload:
    """Whisper: log-mel features through a conv front end into an encoder, and a decoder over fixed tokens."""
    import transformers

    cfg = transformers.WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, encoder_layers=LAYERS, decoder_layers=LAYERS,
                                     d_model=HIDDEN, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
                                     encoder_ffn_dim=2 * HIDDEN, decoder_ffn_dim=2 * HIDDEN, max_source_positions=32,
                                     max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     decoder_start_token_id=1, use_cache=False, mask_time_prob=0.0)
    torch.manual_seed(seed)
    model = transformers.WhisperModel(cfg)
    model.train()
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(BATCH, 16, 64, generator=gen)
    tokens = torch.randint(3, VOCAB, (BATCH, 8), generator=gen)
    net = _Logits(model, lambda m, x: m(input_features=x, decoder_input_ids=tokens).last_hidden_state)
    return Workload("whisper", net, features, lambda out: out.square().mean(), 8)


_LONG = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": LAYERS, "num_attention_heads": 2,
         "intermediate_size": 64}
_VIT_LIKE = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
             "intermediate_size": 2 * HIDDEN, "image_size": 32, "patch_size": 4}
#: Raw audio at a conv feature extractor of two layers (x10 fewer frames); SpecAugment off (its masks are
#: drawn with `np.random`: every step runs verified under the runtime, docs/runtime.md).
_AUDIO = {"hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
          "intermediate_size": 2 * HIDDEN, "conv_dim": (16, 16), "conv_stride": (5, 2), "conv_kernel": (10, 3),
          "num_conv_pos_embeddings": 8, "num_conv_pos_embedding_groups": 4, "mask_time_prob": 0.0, "layerdrop": 0.0}

# ----------------------------------------------------------------------------- plain modules
class InPlaceAttention(nn.Module):
    """`scores = q @ k.T; scores /= 4.0` (Falcon's `attention_scores /= math.sqrt(head_dim)`)."""

    def __init__(self, d: int = HIDDEN) -> None:
        super().__init__()
        self.q, self.k, self.o = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        scores /= 4.0
        return x + self.o(scores.softmax(-1) @ x)


class Routing(nn.Module):
    """Mixtral's token sort: `inv_perm = torch.empty_like(perm); inv_perm[perm] = torch.arange(...)`."""

    def __init__(self, d: int = HIDDEN) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(d, 1), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        perm = self.gate(flat).squeeze(-1).argsort()
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.numel(), device=perm.device)
        y = self.up(flat[perm]).relu()
        return x + y[inv_perm].reshape(x.shape)


class SplitKeys(nn.Module):
    """DeepSeek-V3's `expand_kv`: `keys = k_nope.new_empty(...)`, then `keys[..., :h].copy_(k_nope)` and
    `keys[..., h:].copy_(k_rot)`. The copies join the `new_empty` op (`OpNumbering`), and the `slice`
    views between them are ops of their own: a swap issued at the op's step would copy the tensor
    before its writes."""

    def __init__(self, d: int = HIDDEN) -> None:
        super().__init__()
        self.q, self.k_nope, self.k_rot, self.o = (nn.Linear(d, d), nn.Linear(d, d // 2), nn.Linear(d, d // 2),
                                                   nn.Linear(d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nope, rot = self.k_nope(x), self.k_rot(x)
        keys = nope.new_empty(*nope.shape[:-1], x.shape[-1])
        keys[..., : nope.shape[-1]].copy_(nope)
        keys[..., nope.shape[-1]:].copy_(rot)
        scores = self.q(x) @ keys.transpose(-1, -2)
        return x + self.o(scores.softmax(-1) @ x)


class _Stack(nn.Module):
    def __init__(self, layers: list[nn.Module], d_in: int = HIDDEN, d_out: int = VOCAB) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_in)
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


class MixerBlock(nn.Module):
    def __init__(self, tokens: int = SEQ, d: int = HIDDEN) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.tok = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.ch = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tok(self.n1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.ch(self.n2(x))


class BasicBlock(nn.Module):
    """torchvision's ResNet block: conv-BN-ReLU(in place)-conv-BN, `out += identity`, ReLU in place."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, c: int = 8, classes: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True))
        self.layers = nn.ModuleList([BasicBlock(c) for _ in range(PLAIN_LAYERS)])
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for layer in self.layers:
            h = layer(h)
        return self.fc(h.mean((2, 3)))


class Counted(nn.Module):
    """A buffer mutated in forward (a step counter that scales the activations)."""

    def __init__(self, d: int = HIDDEN) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return x + torch.tanh(self.fc(x)) * (1 + self.calls * 0.01)


class OwnGenerator(nn.Module):
    """A dropout mask drawn from the block's own generator (`torch.rand(..., generator=g)`): a replay
    restores only the default generators' state, so the mask is kept (`replay_check.own_generator`)."""

    def __init__(self, d: int = HIDDEN) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.generator = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.up(x))
        return x + self.down(h * (torch.rand(h.shape, generator=self.generator) > 0.1) / 0.9)


def _mlp(d: int = HIDDEN) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * d, d))


class _Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


def _plain(make: Callable[[], nn.Module], name: str, tie: bool = False) -> Callable[[int], Workload]:
    def build(seed: int) -> Workload:
        torch.manual_seed(seed)
        net = make()
        if tie:
            net.head.weight = net.embed.weight
        net.train()
        batch = _tokens(seed)
        return Workload(name, net, batch, token_loss(batch), VOCAB)

    return build


def _resnet(seed: int) -> Workload:
    torch.manual_seed(seed)
    net = ResNet()
    net.train()
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(BATCH, 3, 8, 8, generator=gen)
    labels = torch.randint(0, 8, (BATCH,), generator=gen)
    return Workload("resnet_bn", net, images, lambda out: nn.functional.cross_entropy(out, labels), 8)


#: Name -> factory(seed) -> Workload. Hugging Face first (config class names), then plain modules.
FACTORIES: dict[str, Callable[[int], Workload]] = {
    "llama": _hf("LlamaConfig", **_DEC),
    "qwen2": _hf("Qwen2Config", **_DEC),
    "qwen3": _hf("Qwen3Config", head_dim=HIDDEN // HEADS, **_DEC),
    "phi3": _hf("Phi3Config", **_DEC),
    "gemma2": _hf("Gemma2Config", head_dim=HIDDEN // HEADS, sliding_window=8, **_DEC),
    "mistral": _hf("MistralConfig", sliding_window=8, **_DEC),
    "starcoder2": _hf("Starcoder2Config", **_DEC),
    "stablelm": _hf("StableLmConfig", **_DEC),
    "mixtral": _hf("MixtralConfig", num_local_experts=4, num_experts_per_tok=2, **_DEC),
    "qwen2_moe": _hf("Qwen2MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
                     shared_expert_intermediate_size=HIDDEN, **_DEC),
    "gpt_neox": _hf("GPTNeoXConfig", **{k: v for k, v in _DEC.items() if k != "num_key_value_heads"}),
    "falcon": _hf("FalconConfig", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, pad_token_id=0, bos_token_id=0, eos_token_id=0),
    "gpt2": _hf("GPT2Config", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64,
                bos_token_id=0, eos_token_id=0),
    "opt": _hf("OPTConfig", vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=2 * HIDDEN, num_hidden_layers=LAYERS,
               num_attention_heads=HEADS, max_position_embeddings=64, word_embed_proj_dim=HIDDEN, pad_token_id=1),
    "bloom": _hf("BloomConfig", vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS),
    # A shorter sequence: without mamba_ssm its selective scan runs several ops per token on the CPU.
    "mamba": _hf("MambaConfig", seq=16, vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                 state_size=8, expand=2, conv_kernel=4, pad_token_id=0),
    # Architectures added after the zoo's first run, to check its rules on models they were not made on:
    # tied input and output embeddings on a Llama, GPT-J's parallel attention and MLP with partial
    # rotary, Cohere's parallel block with tied embeddings and a logit scale, Persimmon's query/key
    # LayerNorm with partial rotary and squared ReLU.
    "llama_tied": _hf("LlamaConfig", tie_word_embeddings=True, **_DEC),
    # DeepSeek-V3: multi-head latent attention (its keys built in a `new_empty` by two slice copies,
    # `SplitKeys` below) and routed plus shared experts after a first dense layer.
    "deepseek_v3": _hf("DeepseekV3Config", n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                       moe_intermediate_size=HIDDEN, first_k_dense_replace=1, n_group=1, topk_group=1,
                       kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                       **{**_DEC, "num_key_value_heads": HEADS}),
    "gptj": _hf("GPTJConfig", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64,
                rotary_dim=HIDDEN // HEADS // 2, n_inner=2 * HIDDEN, bos_token_id=0, eos_token_id=0, pad_token_id=0),
    "cohere": _hf("CohereConfig", **_DEC),
    "persimmon": _hf("PersimmonConfig", qk_layernorm=True, partial_rotary_factor=0.5,
                     **{k: v for k, v in _DEC.items() if k != "num_key_value_heads"}),
    "bert": _hf("BertConfig", "AutoModelForMaskedLM", _mlm, **_ENC),
    "roberta": _hf("RobertaConfig", "AutoModelForMaskedLM", _mlm, **{**_ENC, "pad_token_id": 1}),
    "distilbert": _hf("DistilBertConfig", "AutoModelForMaskedLM", _mlm, vocab_size=VOCAB, dim=HIDDEN,
                      n_layers=LAYERS, n_heads=HEADS, hidden_dim=2 * HIDDEN, max_position_embeddings=64,
                      pad_token_id=0),
    "t5": _hf("T5Config", "AutoModelForSeq2SeqLM", _seq2seq, vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS,
              d_ff=2 * HIDDEN, num_layers=LAYERS, num_heads=HEADS, decoder_start_token_id=0, pad_token_id=0),
    "bart": _hf("BartConfig", "AutoModelForSeq2SeqLM", _seq2seq, vocab_size=VOCAB, d_model=HIDDEN,
                encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                decoder_attention_heads=HEADS, encoder_ffn_dim=2 * HIDDEN, decoder_ffn_dim=2 * HIDDEN,
                max_position_embeddings=64, pad_token_id=1),
    "vit": _vit,
    "mlp_mixer": _plain(lambda: _Stack([MixerBlock() for _ in range(PLAIN_LAYERS)]), "mlp_mixer"),
    "resnet_bn": _resnet,
    "tied": _plain(lambda: _Stack([_Residual(_mlp()) for _ in range(PLAIN_LAYERS)]), "tied", tie=True),
    "buffer_mutated": _plain(lambda: _Stack([Counted() for _ in range(PLAIN_LAYERS)]), "buffer_mutated"),
    "inplace_attention": _plain(lambda: _Stack([InPlaceAttention() for _ in range(PLAIN_LAYERS)]), "inplace_attention"),
    "routing": _plain(lambda: _Stack([Routing() for _ in range(PLAIN_LAYERS)]), "routing"),
    "split_keys": _plain(lambda: _Stack([SplitKeys() for _ in range(PLAIN_LAYERS)]), "split_keys"),
    "own_generator": _plain(lambda: _Stack([OwnGenerator() for _ in range(PLAIN_LAYERS)]), "own_generator"),
}


#: Hugging Face architectures run through the zoo once each to check its rules on models they were not
#: made on (`benchmarks/zoo.py --extra`, benchmarks/results/zoo_extra.json), and not by the test suite:
#: each is another config class of a pattern `FACTORIES` holds (grouped-query decoders, their MoE
#: variants, encoders) or a model of another input (audio through a conv feature extractor, Whisper's
#: encoder-decoder over log-mel features; images through patch and window attention, random patch masking,
#: layer scale, attention over spatially reduced keys, stages of convolution blocks with drop path,
#: convolution and attention blocks with batch norms; text through block-sparse, sliding-window, pooled and
#: landmark attention), and a run of every planner on them takes minutes.
EXTRA_FACTORIES: dict[str, Callable[[int], Workload]] = {
    "gemma": _hf("GemmaConfig", head_dim=HIDDEN // HEADS, **_DEC),
    "gemma3": _hf("Gemma3TextConfig", head_dim=HIDDEN // HEADS, sliding_window=8, **_DEC),
    "olmo": _hf("OlmoConfig", **_DEC),
    "olmo2": _hf("Olmo2Config", **_DEC),
    "phi": _hf("PhiConfig", **{k: v for k, v in _DEC.items() if k != "num_key_value_heads"}),
    "gpt_bigcode": _hf("GPTBigCodeConfig", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                       n_positions=64, bos_token_id=0, eos_token_id=0),
    "mpt": _hf("MptConfig", vocab_size=VOCAB, d_model=HIDDEN, n_layers=LAYERS, n_heads=HEADS, max_seq_len=64),
    "granite": _hf("GraniteConfig", **_DEC),
    "olmoe": _hf("OlmoeConfig", num_experts=4, num_experts_per_tok=2, **_DEC),
    "qwen3_moe": _hf("Qwen3MoeConfig", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=HIDDEN,
                     head_dim=HIDDEN // HEADS, **_DEC),
    "nemotron": _hf("NemotronConfig", **_DEC),
    "glm": _hf("GlmConfig", head_dim=HIDDEN // HEADS, **_DEC),
    "albert": _hf("AlbertConfig", "AutoModelForMaskedLM", _mlm, embedding_size=32, **_ENC),
    "electra": _hf("ElectraConfig", "AutoModelForMaskedLM", _mlm, embedding_size=HIDDEN, **_ENC),
    "deberta_v2": _hf("DebertaV2Config", "AutoModelForMaskedLM", _mlm, **_ENC),
    "modernbert": _hf("ModernBertConfig", "AutoModelForMaskedLM", _mlm, vocab_size=VOCAB, hidden_size=HIDDEN,
                      intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      max_position_embeddings=64, pad_token_id=0, global_attn_every_n_layers=2, local_attention=16),
    "xlnet": _hf("XLNetConfig", vocab_size=VOCAB, d_model=HIDDEN, n_layer=LAYERS, n_head=HEADS, d_inner=2 * HIDDEN),
    "mobilebert": _hf("MobileBertConfig", "AutoModelForMaskedLM", _mlm, vocab_size=VOCAB, hidden_size=HIDDEN,
                      embedding_size=32, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, intra_bottleneck_size=32, true_hidden_size=32,
                      max_position_embeddings=64, pad_token_id=0),
    "wav2vec2": _hf_input("Wav2Vec2Config", "Wav2Vec2Model", _waves, _audio_values, **_AUDIO),
    "hubert": _hf_input("HubertConfig", "HubertModel", _waves, _audio_values, **_AUDIO),
    "vit_mae": _hf_input("ViTMAEConfig", "ViTMAEModel", _images, _pixels, mask_ratio=0.5, **_VIT_LIKE),
    "clip_vision": _hf_input("CLIPVisionConfig", "CLIPVisionModel", _images, _pixels, **_VIT_LIKE),
    "beit": _hf_input("BeitConfig", "BeitModel", _images, _pixels, use_relative_position_bias=True, drop_path_rate=0.1,
                      **_VIT_LIKE),
    "swin": _hf_input("SwinConfig", "SwinModel", _images, _pixels, image_size=32, patch_size=4, embed_dim=16,
                      depths=[2, 2], num_heads=[2, 4], window_size=4, drop_path_rate=0.1),
    "convnext": _hf_input("ConvNextConfig", "ConvNextModel", _images, _pixels, hidden_sizes=[16, 32], depths=[2, 2],
                          num_stages=2, drop_path_rate=0.1),
    "whisper": _whisper,
    "dinov2": _hf_input("Dinov2Config", "Dinov2Model", _images, _pixels, drop_path_rate=0.1, layerscale_value=1.0,
                        **_VIT_LIKE),
    "deit": _hf_input("DeiTConfig", "DeiTModel", _images, _pixels, **_VIT_LIKE),
    "segformer": _hf_input("SegformerConfig", "SegformerModel", _images, _pixels, num_encoder_blocks=2, depths=[1, 1],
                           sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                           num_attention_heads=[1, 2], mlp_ratios=[2, 2], drop_path_rate=0.1),
    "bigbird": _hf_input("BigBirdConfig", "BigBirdModel", _text(256), _ids, attention_type="block_sparse",
                         block_size=16, num_random_blocks=2, max_position_embeddings=256, pad_token_id=0, **_LONG),
    "longformer": _hf_input("LongformerConfig", "LongformerModel", _text(64), _ids, attention_window=16,
                            max_position_embeddings=130, pad_token_id=1, **_LONG),
    "funnel": _hf_input("FunnelConfig", "FunnelBaseModel", _text(64), _ids, vocab_size=VOCAB, d_model=32, n_head=2,
                        d_head=16, d_inner=64, block_sizes=[1, 1], num_decoder_layers=1),
    "nystromformer": _hf_input("NystromformerConfig", "NystromformerModel", _text(64), _ids, num_landmarks=8,
                               segment_means_seq_len=64, max_position_embeddings=130, pad_token_id=1, **_LONG),
    "mobilevit": _hf_input("MobileViTConfig", "MobileViTModel", _images, _pixels, image_size=32, num_attention_heads=2,
                           hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32]),
}


def build(name: str, seed: int = 0) -> Workload:
    """The zoo's `name` model (`FACTORIES` or `EXTRA_FACTORIES`) with weights and batch from `seed` (one
    line naming a bad name)."""
    factory = FACTORIES.get(name) or EXTRA_FACTORIES.get(name)
    if factory is None:
        raise KeyError(f"zoo model {name!r} unknown; known: {', '.join([*FACTORIES, *EXTRA_FACTORIES])}")
    return factory(seed)
