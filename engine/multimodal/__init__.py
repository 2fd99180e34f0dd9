"""Images in prompts (vLLM's multi_modal_data), for LLaVA-style checkpoints (``LlavaForConditionalGeneration``:
a CLIP, SigLIP or Pixtral vision tower and an MLP projector over a Llama, Mistral or Qwen2 language model;
``LlavaNextForConditionalGeneration``, the same over anyres tiles, an image's count of placeholders by its size),
Mistral 3 (Pixtral's tower, rows of image tokens closed by break tokens) and Qwen2-VL / Qwen2.5-VL / Qwen3-VL (an
image resized to a grid of merged patches whose placeholders take M-RoPE positions; Qwen3-VL's deepstack rows).

The prompt holds one image token where each image goes; ``spec.ImageSpec.expand`` widens each into the run of
placeholder tokens the encoder's rows replace (``ImageSpec.tokens_for``: a fixed count, LLaVA-NeXT's
``AnyResGrid``, Qwen-VL's ``MergedPatchGrid`` or Pixtral's ``PixtralGrid`` layout), at most
``limits.max_images_per_prompt`` images a prompt (vLLM's --limit-mm-per-prompt), and records the image (its encoded
bytes, its content digest, where its placeholders are) in ``SamplingParams.mm_inputs``: the images travel wherever
the request's parameters do (router, prefill and decode workers, a request resumed after a worker died, a
tensor-parallel split's other ranks as embeddings). Where a prompt chunk covers placeholders, the runner encodes the
image (``encoders.image_encoder``: ``llava``, ``pixtral`` or ``qwen2_vl``, kept in a small cache by digest:
``step.ImageEmbeds``) and the language model reads those rows' embeddings from it instead of the token table; an
M-RoPE model's rotary positions come from ``mrope.MRope``. The digests are part of the request's block-hash root
(engine/block_manager.py), so KV made with one image is never reused for another.
"""
