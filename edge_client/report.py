"""What a client measured in a round, sent with its update. Every field is optional: a transport fills
what it knows (the simulation's virtual clock fills all of them from a profile, a field agent reports
its training time, and rates measured on its real transfers)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ClientReport:
    compute_s: float | None = None      # seconds of local training this round (t_n^cmp)
    up_Bps: float | None = None         # uplink bytes/s, measured on this round's upload (r_n^u)
    down_Bps: float | None = None       # downlink bytes/s, measured on this round's download (r_n^d)
    upload_bytes: int | None = None     # bytes of the update's tensor body on the wire
    download_bytes: int | None = None   # bytes of the model's tensor body received
    label_score: float | None = None    # FedDD q_n = Σ_c min(C·dis_n^c, 1) (edge_client.feddd.label_score)
