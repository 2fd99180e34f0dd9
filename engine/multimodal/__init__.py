"""Images in prompts (vLLM's multi_modal_data), for LLaVA-style checkpoints (``LlavaForConditionalGeneration``:
a CLIP or SigLIP vision tower and an MLP projector over a Llama, Mistral or Qwen2 language model; and
``LlavaNextForConditionalGeneration``, the same over anyres tiles, an image's count of placeholders by its size).

The prompt holds one image token where each image goes; ``spec.ImageSpec.expand`` widens each into the
placeholder tokens the projector's output replaces (``ImageSpec.tokens_for``: a fixed count, or LLaVA-NeXT's
``AnyResGrid`` layout), at most ``limits.max_images_per_prompt`` images a prompt (vLLM's --limit-mm-per-prompt),
and records the image (its encoded bytes, its content digest, where its placeholders are) in
``SamplingParams.mm_inputs``: the images travel wherever the request's parameters do (router, prefill and decode
workers, a request resumed after a worker died, a tensor-parallel split's other ranks as embeddings). Where a
prompt chunk covers placeholders, the runner encodes the image (``llava.LlavaImageEncoder``, kept in a small
cache by digest: ``step.ImageEmbeds``) and the language model reads those rows' embeddings from it instead of
the token table. The digests are part of the request's block-hash root (engine/block_manager.py), so KV made
with one image is never reused for another.
"""
