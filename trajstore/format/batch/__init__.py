"""Batch structure: what a batch *is*, asked once per batch before anything is encoded.

* ``layout`` - what a dict batch is, decided once: the form (padded by ``attention_mask``, masked by several
  masks or a two-sided one, packed by ``cu_seqlens``, plain), its mask groups, what each tensor field follows;
* ``masks`` - mask groups and the geometry of token masks (``token_mask``, sides, runs, row masks);
* ``check`` - the one structure walk (``plan``): the form, the masks and which fields follow which
  mask, decided once and handed on as a plan to ``Writer.append`` and to the encoder;
* ``containers`` - TensorDict and DataProto-like batches to plain dicts and back;
* ``classes`` - the RL frameworks' own batch classes to plain dicts and lists and back.

May import: the format's shared modules (``format/*.py``: spec, dtypes, limits, values, typed, arrow),
``trajstore.errors``, ``trajstore.integrations``, ``trajstore.base``. Never a codec, shard or file module.
"""
