"""What a run tells about itself: where the time went, the bottleneck rules, peaks and MFU, throughput,
profiles and charts."""
