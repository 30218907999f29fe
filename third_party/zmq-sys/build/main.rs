//! Builds libzmq 4.3.5 from zeromq-src with CURVE (libsodium from
//! libsodium-sys-stable, compiled from its bundled source) and then replaces
//! one object of the static library with a patched build of
//! `src/v2_decoder.cpp` (see `patch_v2_decoder`). Needs only a C/C++ compiler,
//! `make` and `ar`; no cmake, no system libzmq or libsodium.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build/main.rs");
    println!("cargo:rerun-if-env-changed=PROFILE");

    // Exported by libsodium-sys-stable's build script (`links = "sodium"`).
    let sodium_lib = env::var("DEP_SODIUM_LIB").expect("DEP_SODIUM_LIB from libsodium-sys-stable");
    let sodium_include =
        env::var("DEP_SODIUM_INCLUDE").expect("DEP_SODIUM_INCLUDE from libsodium-sys-stable");
    // libzmq's own sources warn a lot; cc would repeat every warning as a
    // cargo warning because this crate is a path dependency.
    for var in ["CFLAGS", "CXXFLAGS"] {
        let mut flags = env::var(var).unwrap_or_default();
        flags.push_str(" -w");
        // libzmq names its threads ("ZMQbg/IO/0", "ZMQbg/Reaper") only with
        // this; the benchmarks' per-thread CPU figures tell them from tokio's.
        flags.push_str(" -DZMQ_HAVE_PTHREAD_SETNAME_2=1");
        // What libzmq's own CMake finds on any Linux but zeromq-src does not
        // define: without ZMQ_HAVE_EVENTFD each wake-up between a socket and
        // its I/O thread is a send() and recv() on a socketpair (the socket
        // driver's largest cost in a profile); the CLOEXEC ones keep libzmq's
        // epoll, eventfd and accepted sockets out of the worker processes
        // the daemon starts.
        flags.push_str(
            " -DZMQ_HAVE_EVENTFD=1 -DZMQ_HAVE_EVENTFD_CLOEXEC=1 \
             -DZMQ_IOTHREAD_POLLER_USE_EPOLL_CLOEXEC=1 -DZMQ_HAVE_SOCK_CLOEXEC=1 -DHAVE_ACCEPT4=1",
        );
        env::set_var(var, flags.trim_start());
    }
    zeromq_src::Build::new()
        .with_libsodium(Some(zeromq_src::LibLocation::new(
            &sodium_lib,
            &sodium_include,
        )))
        .build();

    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    patch_libzmq(&out, Path::new(&sodium_include));
}

const HPP_FROM: &str = "    const bool _zero_copy;\n";
// The new field sits in the padding between `_zero_copy` and the int64
// `_max_msg_size`, so sizeof(v2_decoder_t) and every other field's offset are
// unchanged for the translation units compiled against the original header
// (they only `new` the class and call it through its vtable).
const HPP_TO: &str = "    const bool _zero_copy;\n    uint32_t _msg_sum; // replayd: bytes of the multipart message so far\n";
const CTOR_FROM: &str = "    _zero_copy (zero_copy_),\n";
const CTOR_TO: &str = "    _zero_copy (zero_copy_),\n    _msg_sum (0),\n";
const SIZE_FROM: &str = "    //  Message size must fit into size_t data type.\n";
const SIZE_TO: &str = r#"    //  replayd patch: ZMQ_MAXMSGSIZE also bounds the whole multipart message,
    //  counted as the sum over its frames of (frame size + 64), the 64 being
    //  what each queued frame (a msg_t) costs however small it is. Checked
    //  here, on the frame header, before anything is allocated for the body.
    //  Without it a peer can send one endless multipart message of tiny
    //  frames: no frame is over the limit, and no high-water mark applies
    //  until the message completes, so the receiver's memory grows without
    //  bound. Only applied for limits below 4 GiB (the sum is 32-bit).
    if (_max_msg_size >= 0 && _max_msg_size <= 0xffffffffLL
        && !(_msg_flags & msg_t::command)) {
        const uint64_t sum = static_cast<uint64_t> (_msg_sum) + msg_size_ + 64;
        if (unlikely (sum > static_cast<uint64_t> (_max_msg_size))) {
            errno = EMSGSIZE;
            return -1;
        }
        _msg_sum = (_msg_flags & msg_t::more) ? static_cast<uint32_t> (sum) : 0;
    }

    //  Message size must fit into size_t data type.
"#;

// The I/O thread's spin (epoll.cpp): a global the application sets through
// `replayd_zmq_io_spin_us` (transport::set_io_spin), read each turn.
const EPOLL_TOP_FROM: &str = "#include \"i_poll_events.hpp\"\n";
const EPOLL_TOP_TO: &str = r#"#include "i_poll_events.hpp"
#include <time.h>

//  replayd patch: how long (µs) an I/O thread keeps polling its epoll set
//  without sleeping after it last handled an event; 0 (the default) is
//  libzmq's own behaviour. Set by the application (replayd's
//  `transport::set_io_spin`) before or while sockets run.
extern "C" {
long replayd_zmq_io_spin_us = 0;
}

static uint64_t replayd_now_us ()
{
    struct timespec ts;
    clock_gettime (CLOCK_MONOTONIC, &ts);
    return static_cast<uint64_t> (ts.tv_sec) * 1000000u
           + static_cast<uint64_t> (ts.tv_nsec) / 1000u;
}
"#;
const EPOLL_LOOP_FROM: &str = "    epoll_event ev_buf[max_io_events];\n";
const EPOLL_LOOP_TO: &str =
    "    epoll_event ev_buf[max_io_events];\n    uint64_t replayd_spin_until = 0;\n";
const EPOLL_WAIT_FROM: &str = r#"        const int n = epoll_wait (_epoll_fd, &ev_buf[0], max_io_events,
                                  timeout ? timeout : -1);
"#;
const EPOLL_WAIT_TO: &str = r#"        //  replayd patch: for replayd_zmq_io_spin_us after an event, poll
        //  without sleeping, so that the next message (a reply the
        //  application sends, a request a peer sends) is picked up without
        //  waking a sleeping thread: on a virtual machine a wake-up of an idle
        //  CPU costs several µs on each hop.
        const long spin_us =
          __atomic_load_n (&replayd_zmq_io_spin_us, __ATOMIC_RELAXED);
        int n;
        if (spin_us > 0 && replayd_now_us () < replayd_spin_until)
            n = epoll_wait (_epoll_fd, &ev_buf[0], max_io_events, 0);
        else
            n = epoll_wait (_epoll_fd, &ev_buf[0], max_io_events,
                            timeout ? timeout : -1);
        if (n > 0 && spin_us > 0)
            replayd_spin_until = replayd_now_us () + spin_us;
"#;

fn replace_once(text: &str, from: &str, to: &str, file: &str) -> String {
    assert_eq!(
        text.matches(from).count(),
        1,
        "libzmq patch: {from:?} not found exactly once in {file}"
    );
    text.replacen(from, to, 1)
}

fn patch_libzmq(out: &Path, sodium_include: &Path) {
    // zeromq-src copied libzmq's sources to OUT_DIR/source after compiling.
    let src = out.join("source/src");
    let patched = out.join("patched");
    fs::create_dir_all(&patched).unwrap();
    let hpp = fs::read_to_string(src.join("v2_decoder.hpp")).unwrap();
    let hpp = replace_once(&hpp, HPP_FROM, HPP_TO, "v2_decoder.hpp");
    fs::write(patched.join("v2_decoder.hpp"), hpp).unwrap();
    let cpp = fs::read_to_string(src.join("v2_decoder.cpp")).unwrap();
    let cpp = replace_once(&cpp, CTOR_FROM, CTOR_TO, "v2_decoder.cpp");
    let cpp = replace_once(&cpp, SIZE_FROM, SIZE_TO, "v2_decoder.cpp");
    fs::write(patched.join("v2_decoder.cpp"), cpp).unwrap();
    let cpp = fs::read_to_string(src.join("epoll.cpp")).unwrap();
    let cpp = replace_once(&cpp, EPOLL_TOP_FROM, EPOLL_TOP_TO, "epoll.cpp");
    let cpp = replace_once(&cpp, EPOLL_LOOP_FROM, EPOLL_LOOP_TO, "epoll.cpp");
    let cpp = replace_once(&cpp, EPOLL_WAIT_FROM, EPOLL_WAIT_TO, "epoll.cpp");
    fs::write(patched.join("epoll.cpp"), cpp).unwrap();

    // The same defines zeromq-src uses on Linux (none of them changes the
    // layout of anything v2_decoder.cpp touches).
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .warnings(false)
        .include(&patched) // patched v2_decoder.hpp first
        .include(&src)
        .include(out.join("source/include"))
        .include(out) // the empty platform.hpp zeromq-src wrote
        .include(sodium_include)
        .define("ZMQ_BUILD_TESTS", "OFF")
        .define("ZMQ_USE_CV_IMPL_STL11", "1")
        .define("ZMQ_STATIC", "1")
        .define("ZMQ_USE_BUILTIN_SHA1", "1")
        .define("ZMQ_HAVE_WS", "1")
        .define("ZMQ_USE_LIBSODIUM", "1")
        .define("ZMQ_HAVE_CURVE", "1")
        .define("ZMQ_HAVE_LINUX", "1")
        .define("ZMQ_IOTHREAD_POLLER_USE_EPOLL", "1")
        .define("ZMQ_POLL_BASED_ON_POLL", "1")
        .define("ZMQ_HAVE_IPC", "1")
        .define("HAVE_STRNLEN", "1")
        .define("ZMQ_HAVE_UIO", "1")
        .define("ZMQ_HAVE_STRUCT_SOCKADDR_UN", "1")
        .file(patched.join("v2_decoder.cpp"))
        .file(patched.join("epoll.cpp"));
    let objects = build.compile_intermediates();
    assert_eq!(objects.len(), 2);

    // Swap the objects inside libzmq.a.
    let lib = out.join("lib/libzmq.a");
    for name in ["v2_decoder", "epoll"] {
        let object = objects
            .iter()
            .find(|o| o.to_string_lossy().ends_with(&format!("{name}.o")))
            .unwrap_or_else(|| panic!("{}.o among {:?}", name, objects));
        let members = Command::new("ar").arg("t").arg(&lib).output().expect("run ar");
        assert!(members.status.success(), "ar t failed");
        let members = String::from_utf8_lossy(&members.stdout);
        let suffix = format!("-{name}.o");
        let old: Vec<&str> = members
            .lines()
            .filter(|m| m.ends_with(&suffix) || *m == format!("{name}.o"))
            .collect();
        assert_eq!(old.len(), 1, "{name}.o in libzmq.a: {old:?}");
        let ok = Command::new("ar").arg("d").arg(&lib).arg(old[0]).status().unwrap();
        assert!(ok.success(), "ar d failed");
        let new_obj = out.join(format!("replayd-{name}.o"));
        fs::copy(object, &new_obj).unwrap();
        let ok = Command::new("ar").arg("rs").arg(&lib).arg(&new_obj).status().unwrap();
        assert!(ok.success(), "ar rs failed");
    }
}
