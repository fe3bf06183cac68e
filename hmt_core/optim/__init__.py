"""HMT's low-rank optimizer: pure update math (``update``), typed settings (``settings``), one parameter's state
(``slot``), basis refresh (``refresh``), bookkeeping (``optimizer``), per-layer hooks (``hooks``)."""
