"""solo-learn 1.0.2 DeepClusterV2 (``KMeans.cluster_memory``, solo/utils/kmeans.py): its
distributed k-means starts from K rows that rank 0 draws from its own memory bank alone
(``torch.randperm(len(local_memory_embeddings[j]))``, kmeans.py:94), then broadcasts: a 1/W
share of the samples one device draws its start from. The k-means steps that follow are
distributed (counts and sums all-reduced) but start elsewhere, so the centroids, the
assignments and the loss depend on W: the forward differs from one device's. The same start as
vissl's DeepClusterV2Loss, whose reproducer's k-means and loss (written there, plain torch) this
one runs. The fix: draw the start from every rank's rows, all-gathered in rank order.

``python experiments/census_repro/solo_deepclusterv2.py``;
``PYTHONPATH=experiments python -m gatherlab.check census_cases.solo_learn:SoloDeepClusterV2
--steps 3 --inputs census_cases.solo_learn:sample_indices`` (the released files, as the census
unpacked them, with k-means in float64).
"""

from _ranks import compare
from vissl_deepclusterv2 import criterion, criterion_fixed

if __name__ == "__main__":
    compare("released: the k-means start drawn from rank 0's memory bank", criterion)
    compare("fixed: the start drawn from every rank's memory bank", criterion_fixed)
