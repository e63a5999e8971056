"""A script that builds dpprof.DataParallel itself (not torch's): under dpprof run its steps are recorded."""
import torch

import dpprof

net = dpprof.DataParallel(torch.nn.Linear(8, 2), device_ids=dpprof.cpu_devices(2))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for _ in range(5):
    net(torch.randn(16, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
