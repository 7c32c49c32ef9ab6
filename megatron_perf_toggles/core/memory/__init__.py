"""The peak-memory model and its guard: pure arithmetic on the job's layout, no torch.

``model.py`` is each toggle's change in peak memory and stock's own peak (the job's layout in
``memory_layout.py``, each pipeline rank's layers in ``pipeline_split.py``, its mixture-of-experts
layers in ``memory_moe.py``), ``peaks.py`` where a plan
peaks and each toggle's share of the change, ``memory_guard.py`` backs defaults off where stock fits
and the plan would not, ``allocator.py`` is what PyTorch's caching allocator needs on top of the
largest allocation, and ``memory_words.py`` says the record in words.
"""
