"""What fsdp2 communicates over and with: the mesh taken apart, each rank's pools and derived groups, and stateless collectives on flat buffers; knows no parameter."""
