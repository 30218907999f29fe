//! The shared-memory data plane of the worker link: a ring of slots in a
//! file of the daemon's runtime directory, mapped by the daemon and by its
//! worker, and a `SOCK_SEQPACKET` socket pair (the *doorbell*) that carries
//! only the small link messages that hand a slot over.
//!
//! ```text
//!  daemon (batcher)                         worker (backend thread)
//!  take a free slot, write the rows  ──►  RunShm{slot}  ──►  read the rows, launch
//!  read the output, free the slot   ◄──  Done{slot}    ◄──  write the output
//! ```
//!
//! * **File**: `worker-<device>-<pid>-<generation>.ring`, created by the
//!   device actor with `O_EXCL | O_NOFOLLOW`, mode `0600` (owner only,
//!   whatever the umask or `server.runtime_group`), before it starts the
//!   worker; the worker refuses a file that is not a regular file owned by
//!   its user with no group or other permissions. It is removed when that
//!   worker exits; each worker generation has its own ring.
//! * **Layout**: a 4 KiB header (magic, version, the [`RingSpec`]), then
//!   `slots` slots, each an input region (token sequences: `seqs` lengths
//!   then every id, native-endian `u32`; feature rows: `f32` values) and an
//!   output region (`rows · output_dim` `f32`), both page-aligned.
//! * **Ownership**: a slot belongs to the daemon while free, to the worker
//!   from the `RunShm` that names it until the `Done`/`Failed` that returns
//!   it. The messages order the accesses (each side fences before it sends
//!   and after it receives); neither side touches a slot it does not own.
//! * **Death**: a dead worker's ring is dropped whole with its generation;
//!   the batches it held are re-dispatched from the batcher's own copy
//!   (nothing is read back from a dead worker's slots), so the shared-memory
//!   path loses nothing that the socket path would not.
//!
//! The worker stages a slot's rows into the backend's own pinned buffers
//! (the CUDA backend packs them into its pinned staging slot, from which one
//! `cuMemcpyHtoDAsync` feeds the graph), and copies each output back into its
//! slot: one copy each way between the processes, none through a socket.

use crate::model::BatchRows;
use serde::{Deserialize, Serialize};
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, Ordering};

const MAGIC: u64 = u64::from_le_bytes(*b"replayd\x01");
const VERSION: u32 = 1;
const HEADER_BYTES: usize = 4096;
const PAGE: usize = 4096;

fn page_align(n: usize) -> usize {
    n.div_ceil(PAGE) * PAGE
}

/// The shape of a ring: how many slots, and each slot's input and output capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingSpec {
    pub slots: u32,
    pub input_bytes: u64,
    pub output_bytes: u64,
}

impl RingSpec {
    fn input_stride(&self) -> usize {
        page_align(self.input_bytes as usize)
    }

    fn slot_bytes(&self) -> usize {
        self.input_stride() + page_align(self.output_bytes as usize)
    }

    /// Bytes of the whole file.
    pub fn file_bytes(&self) -> usize {
        HEADER_BYTES + self.slots as usize * self.slot_bytes()
    }
}

/// How a slot's input region holds a batch's rows (carried by `RunShm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SlotRows {
    /// `seqs` lengths, then `ids` ids, all `u32`.
    Tokens { seqs: u32, ids: u32 },
    /// `rows · features` `f32`.
    Features { rows: u32, features: u32 },
}

impl SlotRows {
    /// Input bytes these rows take.
    pub fn bytes(&self) -> usize {
        match *self {
            SlotRows::Tokens { seqs, ids } => 4 * (seqs as usize + ids as usize),
            SlotRows::Features { rows, features } => 4 * rows as usize * features as usize,
        }
    }
}

/// A mapped ring (see the module docs).
pub struct Ring {
    ptr: *mut u8,
    len: usize,
    spec: RingSpec,
    path: PathBuf,
}

// SAFETY: the mapping is plain shared memory; which side may touch a slot is
// decided by the link protocol (module docs), and the daemon's free list
// (behind a mutex) hands each free slot to one writer at a time.
unsafe impl Send for Ring {}
unsafe impl Sync for Ring {}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("path", &self.path)
            .field("spec", &self.spec)
            .finish()
    }
}

fn map(file: &File, len: usize) -> io::Result<*mut u8> {
    // SAFETY: a fresh shared mapping of a file we hold open, of its length.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    Ok(ptr as *mut u8)
}

fn bad(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

impl Ring {
    /// Creates the ring file at `path` (which must not exist), owner-only,
    /// and maps it (the daemon).
    pub fn create(path: &Path, spec: RingSpec) -> io::Result<Ring> {
        if spec.slots == 0 {
            return Err(bad("a ring needs at least one slot".into()));
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)?;
        // Whatever the umask: owner only.
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
        let len = spec.file_bytes();
        file.set_len(len as u64)?;
        let ptr = map(&file, len)?;
        let ring = Ring {
            ptr,
            len,
            spec,
            path: path.to_path_buf(),
        };
        // SAFETY: the header is ours (nobody else has mapped the file yet).
        unsafe {
            let h = ring.ptr;
            (h as *mut u64).write(MAGIC);
            (h.add(8) as *mut u32).write(VERSION);
            (h.add(12) as *mut u32).write(spec.slots);
            (h.add(16) as *mut u64).write(spec.input_bytes);
            (h.add(24) as *mut u64).write(spec.output_bytes);
        }
        Ok(ring)
    }

    /// Opens and maps the ring the daemon created (the worker). Refuses a
    /// file that is not a regular file of this user, owner-only.
    pub fn open(path: &Path) -> io::Result<Ring> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)?;
        let meta = file.metadata()?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if !meta.file_type().is_file() || meta.uid() != me || meta.mode() & 0o077 != 0 {
            return Err(bad(format!(
                "{}: not an owner-only regular file of uid {me} (uid {}, mode {:o})",
                path.display(),
                meta.uid(),
                meta.mode() & 0o7777
            )));
        }
        let len = meta.len() as usize;
        if len < HEADER_BYTES {
            return Err(bad(format!("{}: too short for a ring", path.display())));
        }
        let ptr = map(&file, len)?;
        // SAFETY: the header lies within the mapping; the daemon wrote it
        // before starting this process.
        let (magic, version, spec) = unsafe {
            (
                (ptr as *const u64).read(),
                (ptr.add(8) as *const u32).read(),
                RingSpec {
                    slots: (ptr.add(12) as *const u32).read(),
                    input_bytes: (ptr.add(16) as *const u64).read(),
                    output_bytes: (ptr.add(24) as *const u64).read(),
                },
            )
        };
        let ring = Ring {
            ptr,
            len,
            spec,
            path: path.to_path_buf(),
        };
        if magic != MAGIC || version != VERSION {
            return Err(bad(format!("{}: not a replayd ring", path.display())));
        }
        if spec.slots == 0 || spec.file_bytes() != len {
            return Err(bad(format!(
                "{}: {len} bytes do not match its header {spec:?}",
                path.display()
            )));
        }
        Ok(ring)
    }

    pub fn spec(&self) -> RingSpec {
        self.spec
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check(&self, slot: u32) -> Result<(), String> {
        if slot >= self.spec.slots {
            return Err(format!(
                "slot {slot} outside the ring's {}",
                self.spec.slots
            ));
        }
        Ok(())
    }

    fn input_ptr(&self, slot: u32) -> *mut u8 {
        // SAFETY: callers checked `slot`; in bounds by construction of the spec.
        unsafe {
            self.ptr
                .add(HEADER_BYTES + slot as usize * self.spec.slot_bytes())
        }
    }

    fn output_ptr(&self, slot: u32) -> *mut u8 {
        // SAFETY: as above; the output region follows the input region.
        unsafe { self.input_ptr(slot).add(self.spec.input_stride()) }
    }

    /// Writes a batch's rows (its parts, in order) into `slot` (daemon).
    /// `None` when they do not fit the slot or mix tokens and features:
    /// such a batch takes the socket.
    ///
    /// The caller must own `slot` (taken from its free list).
    pub fn write_rows<'a>(
        &self,
        slot: u32,
        parts: impl IntoIterator<Item = &'a BatchRows> + Clone,
    ) -> Option<SlotRows> {
        self.check(slot).ok()?;
        let mut seqs = 0usize;
        let mut ids = 0usize;
        let mut rows = 0usize;
        let mut features = None;
        for p in parts.clone() {
            match p {
                BatchRows::Tokens(s) => {
                    seqs += s.len();
                    ids += s.iter().map(Vec::len).sum::<usize>();
                }
                BatchRows::Features { features: f, data } => {
                    if features.is_some_and(|g| g != *f) {
                        return None;
                    }
                    features = Some(*f);
                    rows += data.len() / (*f).max(1);
                }
            }
        }
        let shape = match features {
            None => SlotRows::Tokens {
                seqs: u32::try_from(seqs).ok()?,
                ids: u32::try_from(ids).ok()?,
            },
            Some(_) if seqs > 0 => return None,
            Some(f) => SlotRows::Features {
                rows: u32::try_from(rows).ok()?,
                features: u32::try_from(f).ok()?,
            },
        };
        if shape.bytes() > self.spec.input_bytes as usize {
            return None;
        }
        let base = self.input_ptr(slot);
        // SAFETY: the slot is the caller's; every write below stays within
        // `shape.bytes()` ≤ the input region; the region is page-aligned, so
        // u32/f32 writes are aligned.
        unsafe {
            match shape {
                SlotRows::Tokens { seqs, .. } => {
                    let lens = base as *mut u32;
                    let mut id_at = (base as *mut u32).add(seqs as usize);
                    let mut i = 0;
                    for p in parts {
                        if let BatchRows::Tokens(s) = p {
                            for seq in s {
                                lens.add(i).write(seq.len() as u32);
                                std::ptr::copy_nonoverlapping(seq.as_ptr(), id_at, seq.len());
                                id_at = id_at.add(seq.len());
                                i += 1;
                            }
                        }
                    }
                }
                SlotRows::Features { .. } => {
                    let mut at = base as *mut f32;
                    for p in parts {
                        if let BatchRows::Features { data, .. } = p {
                            std::ptr::copy_nonoverlapping(data.as_ptr(), at, data.len());
                            at = at.add(data.len());
                        }
                    }
                }
            }
        }
        // The worker reads the slot after the message that names it.
        fence(Ordering::Release);
        Some(shape)
    }

    /// Reads the rows the daemon wrote into `slot` (worker).
    pub fn read_rows(&self, slot: u32, shape: SlotRows) -> Result<BatchRows, String> {
        self.check(slot)?;
        if shape.bytes() > self.spec.input_bytes as usize {
            return Err(format!(
                "{shape:?} is larger than a slot's {} input bytes",
                self.spec.input_bytes
            ));
        }
        fence(Ordering::Acquire);
        let base = self.input_ptr(slot);
        // SAFETY: within the slot's input region (checked above); the slot is
        // the worker's from the RunShm that named it.
        unsafe {
            match shape {
                SlotRows::Tokens { seqs, ids } => {
                    let lens = std::slice::from_raw_parts(base as *const u32, seqs as usize);
                    let all = std::slice::from_raw_parts(
                        (base as *const u32).add(seqs as usize),
                        ids as usize,
                    );
                    let total: usize = lens.iter().map(|&l| l as usize).sum();
                    if total != ids as usize {
                        return Err(format!(
                            "slot {slot}: lengths add up to {total} ids, the message says {ids}"
                        ));
                    }
                    let mut at = 0;
                    Ok(BatchRows::Tokens(
                        lens.iter()
                            .map(|&l| {
                                let seq = all[at..at + l as usize].to_vec();
                                at += l as usize;
                                seq
                            })
                            .collect(),
                    ))
                }
                SlotRows::Features { rows, features } => {
                    let n = rows as usize * features as usize;
                    Ok(BatchRows::Features {
                        features: features as usize,
                        data: std::slice::from_raw_parts(base as *const f32, n).to_vec(),
                    })
                }
            }
        }
    }

    /// Writes a batch's output into `slot` (worker, which owns it).
    pub fn write_output(&self, slot: u32, values: &[f32]) -> Result<(), String> {
        self.check(slot)?;
        if values.len() * 4 > self.spec.output_bytes as usize {
            return Err(format!(
                "an output of {} values does not fit a slot's {} bytes",
                values.len(),
                self.spec.output_bytes
            ));
        }
        // SAFETY: within the slot's output region (checked), which is
        // page-aligned for f32.
        unsafe {
            std::ptr::copy_nonoverlapping(
                values.as_ptr(),
                self.output_ptr(slot) as *mut f32,
                values.len(),
            )
        };
        fence(Ordering::Release);
        Ok(())
    }

    /// Copies the first `values` output values of `slot` out as
    /// little-endian bytes (daemon, after the `Done` that returned it).
    pub fn read_output(&self, slot: u32, values: usize) -> Result<bytes::Bytes, String> {
        self.check(slot)?;
        let n = values
            .checked_mul(4)
            .filter(|&n| n <= self.spec.output_bytes as usize)
            .ok_or_else(|| {
                format!(
                    "{values} output values do not fit a slot's {} bytes",
                    self.spec.output_bytes
                )
            })?;
        fence(Ordering::Acquire);
        // SAFETY: within the slot's output region; the worker wrote it and
        // returned the slot. f32 is stored native-endian, which on the
        // little-endian hosts replayd runs on is the wire's little-endian.
        let bytes = unsafe { std::slice::from_raw_parts(self.output_ptr(slot), n) };
        Ok(bytes::Bytes::copy_from_slice(bytes))
    }
}

#[cfg(not(target_endian = "little"))]
compile_error!(
    "the ring stores ids and outputs native-endian, which the wire assumes is little-endian"
);

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in create/open.
        unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
    }
}

/// A connected `SOCK_SEQPACKET` pair, close-on-exec: (daemon end, worker end).
pub fn doorbell_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: socketpair writes two fds into the array on success.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds are fresh and ours.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Sends one message on a doorbell (`nonblocking`: fail with `WouldBlock`
/// rather than wait for room).
pub fn ring_send(fd: RawFd, msg: &[u8], nonblocking: bool) -> io::Result<()> {
    let flags = libc::MSG_NOSIGNAL | if nonblocking { libc::MSG_DONTWAIT } else { 0 };
    loop {
        // SAFETY: sends `msg.len()` bytes from a live slice.
        let n = unsafe { libc::send(fd, msg.as_ptr() as *const libc::c_void, msg.len(), flags) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Receives one message without waiting: `Ok(None)` when there is none,
/// `Err(UnexpectedEof)` when the other end is closed.
pub fn ring_recv(fd: RawFd, buf: &mut [u8]) -> io::Result<Option<usize>> {
    loop {
        // SAFETY: receives into a live buffer of its length.
        let n = unsafe {
            libc::recv(
                fd,
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n > 0 {
            return Ok(Some(n as usize));
        }
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// Largest doorbell message (an error message is cut to fit).
pub const MAX_DOORBELL_MESSAGE: usize = 64 << 10;

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> RingSpec {
        RingSpec {
            slots: 3,
            input_bytes: 100,
            output_bytes: 64,
        }
    }

    #[test]
    fn rows_and_outputs_cross_the_ring() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.ring");
        let daemon = Ring::create(&path, spec()).unwrap();
        let worker = Ring::open(&path).unwrap();
        assert_eq!(worker.spec(), spec());
        let a = BatchRows::Tokens(vec![vec![101, 7, 102], vec![]]);
        let b = BatchRows::Tokens(vec![vec![101, 102]]);
        let shape = daemon.write_rows(1, [&a, &b]).unwrap();
        assert_eq!(shape, SlotRows::Tokens { seqs: 3, ids: 5 });
        assert_eq!(
            worker.read_rows(1, shape).unwrap(),
            BatchRows::Tokens(vec![vec![101, 7, 102], vec![], vec![101, 102]])
        );
        worker.write_output(1, &[1.0, -2.5, 3.0]).unwrap();
        let out = daemon.read_output(1, 3).unwrap();
        assert_eq!(crate::tensor::f32s_from_le(&out), vec![1.0, -2.5, 3.0]);

        let f = BatchRows::Features {
            features: 2,
            data: vec![1.0, 2.0, 3.0, 4.0],
        };
        let shape = daemon.write_rows(0, [&f]).unwrap();
        assert_eq!(worker.read_rows(0, shape).unwrap(), f);
        // Too large for a slot, mixed kinds, a slot outside the ring: refused.
        let big = BatchRows::Tokens(vec![vec![1; 30]]);
        assert_eq!(daemon.write_rows(2, [&big]), None);
        assert_eq!(daemon.write_rows(2, [&a, &f]), None);
        assert_eq!(daemon.write_rows(3, [&a]), None);
        assert!(worker.write_output(0, &[0.0; 17]).is_err());
        assert!(daemon.read_output(0, 17).is_err());
        assert!(worker
            .read_rows(0, SlotRows::Tokens { seqs: 1, ids: 30 })
            .is_err());
    }

    #[test]
    fn ring_files_are_owner_only_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.ring");
        // A permissive umask does not widen the file.
        // SAFETY: umask only changes this process's creation mask; restored below.
        let old = unsafe { libc::umask(0o000) };
        let ring = Ring::create(&path, spec());
        unsafe { libc::umask(old) };
        let _ring = ring.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // It is never overwritten, nor followed through a symlink.
        assert!(Ring::create(&path, spec()).is_err());
        let link = dir.path().join("link.ring");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        assert!(Ring::create(&link, spec()).is_err());
        assert!(Ring::open(&link).is_err());
        // The worker refuses a ring others could read or write.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        let err = Ring::open(&path).unwrap_err().to_string();
        assert!(err.contains("owner-only"), "{err}");
        let junk = dir.path().join("junk.ring");
        std::fs::write(&junk, vec![0u8; 8192]).unwrap();
        std::fs::set_permissions(&junk, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Ring::open(&junk).is_err());
    }

    #[test]
    fn doorbells_carry_messages_and_report_a_closed_end() {
        let (a, b) = doorbell_pair().unwrap();
        ring_send(a.as_raw_fd(), b"hello", true).unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(ring_recv(b.as_raw_fd(), &mut buf).unwrap(), Some(5));
        assert_eq!(&buf[..5], b"hello");
        assert_eq!(ring_recv(b.as_raw_fd(), &mut buf).unwrap(), None);
        drop(a);
        let r = ring_recv(b.as_raw_fd(), &mut buf);
        assert!(
            matches!(&r, Err(e) if e.kind() == io::ErrorKind::UnexpectedEof),
            "{r:?}"
        );
    }
}
