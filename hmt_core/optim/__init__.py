"""HMT's low-rank optimizer: pure update math (``update``), bookkeeping (``optimizer``), per-layer hooks (``hooks``)."""
