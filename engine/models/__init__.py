"""The networks: Llama family, NemotronH (Mamba2 hybrid), MoE blocks, the MTP draft head, GGUF conversion, built-in tiny models and the name -> directory registry."""
