"""Model sources: one module per kind of spec :func:`posinterp.load_model` reads, each
independent of the dispatcher (:mod:`posinterp.models.pretrained`, whose ``SOURCES`` table
maps a spec kind to its source's ``load``).

* :mod:`.common`: plumbing every source shares (offline HF reads, TL's handled warnings,
  ``config.json``, MLA refusal, what TL's weight processing did);
* :mod:`.hf_files`: which weight files of an HF folder transformers reads, refusal of
  incomplete checkpoints, a digest of their tensors;
* :mod:`.hf_folder`: a local HF checkpoint folder, checked against HF's own model;
* :mod:`.hub`: hub names through the Hugging Face cache;
* :mod:`.gguf`: GGUF files, dequantized into an HF folder;
* :mod:`.llama2c`: llama2.c ``.bin`` files;
* :mod:`.encoder`: BERT encoders (all-MiniLM-L6-v2);
* :mod:`.qk_only`: W_Q, W_K and attention-norm gains read alone (weights-only spectra);
* :mod:`.toy`: posinterp's own toy checkpoint folders and zoo models.
"""
