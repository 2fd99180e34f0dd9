"""What two or more KV transports share: chunking, wire headers, sealing, admission, landing, their
threads, and the mapped-cache push sender and receiver that shm and cuda_ipc both use."""
