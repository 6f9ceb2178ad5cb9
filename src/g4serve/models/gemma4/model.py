"""The whole Gemma 4 model: text decoder plus optional vision and audio towers.

Encoders turn media into soft tokens in text space; ``forward`` puts them at the
placeholder tokens of the flat token batch and runs the decoder. Text-only mode builds
no towers at all, so their memory goes to the KV cache.

Under tensor parallelism (``tp``) the decoder is this rank's shard: ``cfg.text`` is then the shard's config
(its heads and intermediate sizes per rank), ``shard_plan`` cuts checkpoint tensors to it, and the towers,
replicated, are built on rank 0 alone (the engine's encoder runs there).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from g4serve.config import Gemma4Config
from g4serve.distributed import SINGLE, TensorParallel
from g4serve.distributed.sharding import ShardPlan, shard_text_config
from g4serve.layers.attention import AttentionBackend, AttentionMetadata
from g4serve.layers.lora import LoRABatch
from g4serve.models.gemma4.audio import Gemma4AudioModel
from g4serve.models.gemma4.multimodal import MultimodalEmbedder
from g4serve.models.gemma4.text import Gemma4TextModel
from g4serve.models.gemma4.vision import Gemma4VisionModel


class Gemma4Model(nn.Module):
    def __init__(
        self,
        cfg: Gemma4Config,
        with_vision: bool = True,
        with_audio: bool = True,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        self.tp = tp
        ep = tp.expert_parallel
        self.shard_plan = ShardPlan(cfg.text, tp.rank, tp.size, ep) if tp.size > 1 else None
        if tp.size > 1:
            cfg = replace(cfg, text=shard_text_config(cfg.text, tp.size, ep))
        self.cfg = cfg
        text_hidden = cfg.text.hidden_size
        self.language_model = Gemma4TextModel(cfg.text, tp)
        self.vision_tower = self.embed_vision = None
        self.audio_tower = self.embed_audio = None
        if cfg.vision is not None and with_vision:
            self.vision_tower = Gemma4VisionModel(cfg.vision)
            self.embed_vision = MultimodalEmbedder(
                cfg.vision.hidden_size, text_hidden, cfg.vision.rms_norm_eps
            )
        if cfg.audio is not None and with_audio:
            self.audio_tower = Gemma4AudioModel(cfg.audio)
            self.embed_audio = MultimodalEmbedder(
                cfg.audio.output_proj_dims, text_hidden, cfg.audio.rms_norm_eps
            )
        self.register_buffer(
            "mm_token_ids",
            torch.tensor([cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id]),
            persistent=False,
        )

    def init_nonpersistent_buffers(self) -> None:
        device = self.language_model.norm.weight.device
        self.mm_token_ids = torch.tensor(
            [self.cfg.image_token_id, self.cfg.video_token_id, self.cfg.audio_token_id], device=device
        )

    def prepare_fast_path(self) -> None:
        """Accelerator weight layout, once after loading: stacked decoder projections, and no clamps in the
        towers' linears whose bounds are all infinite. The CPU reference path keeps the checkpoint's
        layout."""
        from g4serve.layers.quant import prepare_int4_layouts
        from g4serve.models.gemma4.multimodal import ClippableLinear

        self.language_model.fuse_projections()
        prepare_int4_layouts(self.language_model)  # G4SERVE_INT4_MATMUL=tinygemm
        for module in self.modules():
            if isinstance(module, ClippableLinear):
                module.drop_unbounded_clipping()

    # ---- encoders ------------------------------------------------------------------------
    def encode_images(self, pixel_values: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
        """Images or video frames [B, N, 3*p*p] -> per item soft tokens [n_i, text_hidden]."""
        if self.vision_tower is None:
            raise ValueError("this model was loaded without its vision tower (text-only mode)")
        tokens = self.embed_vision(self.vision_tower(pixel_values, position_ids))
        k2 = self.cfg.vision.pooling_kernel_size**2
        counts = ((position_ids != -1).all(dim=-1).sum(dim=-1) // k2).tolist()
        return list(torch.split(tokens, counts))

    def encode_images_padded(
        self, pixel_values: torch.Tensor, position_ids: torch.Tensor, no_padding: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``encode_images`` with fixed shapes (for CUDA graphs): soft tokens of every pooling cell
        [B, L, text_hidden] and the cells that hold one [B, L] (row-wise ops, so the kept rows are the same).
        ``no_padding``: every patch is real (checked by the caller), so attention needs no mask."""
        if self.vision_tower is None:
            raise ValueError("this model was loaded without its vision tower (text-only mode)")
        tokens, is_used = self.vision_tower.forward_padded(pixel_values, position_ids, no_padding)
        return self.embed_vision(tokens), is_used

    def encode_audio(
        self, features: torch.Tensor, mask: torch.Tensor, lengths: list[int] | None = None
    ) -> list[torch.Tensor]:
        """Log-mel features [B, T, 128] with validity mask -> per clip soft tokens [n_i, text_hidden].
        ``lengths``: each clip's soft-token count, known on the host (the processor's); a clip's valid
        frames are a prefix, so its tokens are then sliced without reading the device's mask back."""
        if self.audio_tower is None:
            raise ValueError("this model was loaded without its audio tower (text-only mode or no audio)")
        hidden, out_mask = self.audio_tower(features, mask)
        tokens = self.embed_audio(hidden)
        if lengths is not None:
            return [tokens[i, :n] for i, n in enumerate(lengths)]
        return [tokens[i][out_mask[i]] for i in range(tokens.shape[0])]

    # ---- decoder ---------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        mm_embeds: torch.Tensor | None = None,
        keep_indices: list[int] | torch.Tensor | None = None,
        mm_positions: torch.Tensor | None = None,
        kept_meta: AttentionMetadata | None = None,
        mm_dense: tuple[torch.Tensor, torch.Tensor] | None = None,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Flat ``input_ids`` [T] -> final hidden states (of ``keep_indices`` if given).

        ``mm_embeds`` [M, H] holds soft tokens for the rows ``mm_positions`` [M] of the batch;
        without positions, for every placeholder token in order of appearance. Placeholder ids
        are always embedded as padding first, as transformers does (a model may also *generate*
        a placeholder id; it then gets the padding embedding and no soft token).
        """
        lm = self.language_model
        is_mm = torch.isin(input_ids, self.mm_token_ids)
        # Placeholders may lie outside the text vocabulary: embed them as padding, then overwrite.
        text_ids = torch.where(is_mm, self.cfg.text.pad_token_id, input_ids)
        embeds = lm.embed(text_ids)
        if mm_dense is not None:
            # Fixed-shape form (CUDA graphs): a soft-token row for every token, used where the mask is set.
            mask, rows = mm_dense
            embeds = torch.where(mask.unsqueeze(-1), rows.to(embeds.dtype), embeds)
        elif mm_embeds is not None and mm_embeds.shape[0] and mm_positions is not None:
            if mm_positions.shape[0] != mm_embeds.shape[0]:
                raise ValueError(
                    f"{mm_positions.shape[0]} multimodal positions but {mm_embeds.shape[0]} soft tokens"
                )
            embeds = embeds.index_copy(0, mm_positions, mm_embeds.to(embeds.dtype))
        elif mm_embeds is not None and mm_embeds.shape[0]:
            if int(is_mm.sum()) != mm_embeds.shape[0]:
                raise ValueError(
                    f"{int(is_mm.sum())} multimodal placeholder tokens but "
                    f"{mm_embeds.shape[0]} soft tokens given"
                )
            embeds = embeds.masked_scatter(is_mm.unsqueeze(-1), mm_embeds.to(embeds.dtype))
        return lm(embeds, text_ids, meta, backend, keep_indices, kept_meta, lora)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)
