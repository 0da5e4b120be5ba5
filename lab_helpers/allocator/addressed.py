"""The allocator model with the CUDA driver's segment addresses, unbounded or on a device of bounded memory.

`AddressedAllocator` is the default model (lab_helpers.allocator.model) whose new segments are mapped
where the driver was seen to map them (lab_helpers.allocator.addresses); `CappedAllocator` adds the
budget's release-and-retry, then OutOfMemory (lab_helpers.allocator.budget). Standard library only.
"""
from lab_helpers.allocator.addresses import DriverAddresses
from lab_helpers.allocator.budget import BudgetMixin, OutOfMemory
from lab_helpers.allocator.model import AllocatorModel


class AddressedAllocator(AllocatorModel):
    """AllocatorModel whose segments get addresses the way the CUDA driver was seen to map them
    (lab_helpers.allocator.addresses): among free blocks of equal size the caching allocator takes
    the lowest address, so the order of the segments decides which one a request lands in."""

    def __init__(self):
        super().__init__()
        self.addresses = DriverAddresses()

    def segment_address(self, segment_bytes: int, request_bytes: int) -> int:
        return self.addresses.map(segment_bytes)

    def give_back(self, block) -> None:
        """A released segment's address range, mapped again by a later segment."""
        self.addresses.release(block.address, block.size)


class CappedAllocator(BudgetMixin, AddressedAllocator):
    """AddressedAllocator on a device where reserved may reach `capacity_bytes` (None: unbounded):
    lab_helpers.allocator.budget's release-and-retry, then OutOfMemory. The budget may change
    between phases (`budget_bytes`)."""

    error = OutOfMemory  # what malloc raises past the budget

    def __init__(self, capacity_bytes=None):
        super().__init__()
        self.budget_bytes = capacity_bytes

    @property
    def capacity_bytes(self):
        return self.budget_bytes

    def segment_released(self, block) -> None:
        self.give_back(block)
