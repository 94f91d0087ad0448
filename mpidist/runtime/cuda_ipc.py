"""Device memory another process of the node maps: the six operations an
:class:`~mpidist.runtime.ipc_link.IpcLink` asks of the device, on CUDA through cupy.

The memory a link exports is allocated with ``cudaMalloc`` itself, not from
cupy's pool: a handle names a whole allocation, and a pooled block is a part
of one (its handle would need the offset, and the pool may hand the rest
out).  Copies are queued on the current stream, after the kernels that made
the array; :meth:`CudaMemory.wait` waits for them.
"""


class CudaMemory:
    """CUDA IPC through cupy's runtime bindings."""

    def __init__(self):
        import cupy

        self.cupy, self.runtime = cupy, cupy.cuda.runtime

    def alloc(self, nbytes):
        """``(pointer, handle)``: ``nbytes`` of device memory of this process's own, and the handle that maps
        it in another."""
        pointer = self.runtime.malloc(nbytes)
        return pointer, bytes(self.runtime.ipcGetMemHandle(pointer))

    def free(self, pointer):
        """Free what :meth:`alloc` made."""
        self.runtime.free(pointer)

    def open(self, handle):
        """The pointer to another process's memory that ``handle`` names (peer access enabled as needed)."""
        return self.runtime.ipcOpenMemHandle(handle, self.runtime.cudaIpcMemLazyEnablePeerAccess)

    def close(self, pointer):
        """Unmap what :meth:`open` mapped."""
        self.runtime.ipcCloseMemHandle(pointer)

    def put(self, pointer, array):
        """Queue a copy of ``array`` (contiguous) to ``pointer``."""
        self._copy(pointer, array.data.ptr, array.nbytes)

    def take(self, buffer, pointer, nbytes):
        """Queue a copy of ``nbytes`` at ``pointer`` into ``buffer`` (contiguous)."""
        self._copy(buffer.data.ptr, pointer, nbytes)

    def wait(self):
        """Wait for the copies queued so far."""
        self.cupy.cuda.get_current_stream().synchronize()

    def _copy(self, destination, source, nbytes):
        stream = self.cupy.cuda.get_current_stream().ptr
        self.runtime.memcpyAsync(destination, source, nbytes, self.runtime.memcpyDeviceToDevice, stream)
