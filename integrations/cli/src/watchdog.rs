//! `twm run --timeout`: durations on the command line, and the watchdog that ends the process
//! when a guest is blocked in a host call the engine's deadline cannot interrupt.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// The exit status of a run that timed out (as `timeout(1)` and `wasmtime run -W timeout=`
/// report it: 124).
pub const TIMEOUT_EXIT: u8 = 124;

/// The longest `--timeout` (a day): anything longer is no limit an operator means.
pub const LONGEST: Duration = Duration::from_secs(24 * 60 * 60);

/// Parses a duration: a number with a unit (`250ms`, `1.5s`, `2m`, `1h`; `us`, `ms`, `s`, `m`,
/// `h`), or a bare number of seconds. Between 1 ms and [`LONGEST`].
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration (try 500ms, 10s, 2m)"))?;
    let seconds = match unit.trim() {
        "" | "s" => value,
        "us" => value / 1e6,
        "ms" => value / 1e3,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        other => {
            return Err(format!(
                "unknown duration unit {other:?} (use ms, s, m or h)"
            ));
        }
    };
    if !(0.001..=LONGEST.as_secs_f64()).contains(&seconds) {
        return Err(format!("{text:?} is out of range (1ms to 24h)"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// The epoch tick for a timeout: a tenth of it, between 1 ms and 100 ms (the deadline fires at
/// most one tick late, never early).
#[must_use]
pub fn tick_for(timeout: Duration) -> Duration {
    (timeout / 10).clamp(Duration::from_millis(1), Duration::from_millis(100))
}

struct Armed {
    until: Option<Instant>,
    done: bool,
}

/// How long past a timeout the watchdog is armed for: what a run's own interruption (and
/// `twm`'s last words after it) may take before the watchdog ends the process.
pub const GRACE: Duration = Duration::from_millis(250);

/// How long the watchdog lets its report take before it ends the process all the same.
const REPORT_GRACE: Duration = Duration::from_millis(200);

/// Writes `text` to the process's file descriptor `fd` (1 or 2) with `write(2)`: never through
/// Rust's `stdout()` / `stderr()`, whose locks a guest blocked in a write may hold, without
/// opening a descriptor (a process that has none left still reports), and never panicking on a
/// closed, full or broken stream.
pub fn write_fd(fd: u8, text: &str) {
    // Straight to the descriptor: no lock a blocked writer holds, and no descriptor of its
    // own to open (a process out of descriptors still reports). A short or failed write is
    // given up on: the process ends either way.
    use std::os::fd::AsFd;
    let (stdout, stderr) = (std::io::stdout(), std::io::stderr());
    // The streams' descriptors, borrowed without their locks.
    let target = if fd == 1 {
        stdout.as_fd()
    } else {
        stderr.as_fd()
    };
    let mut rest = text.as_bytes();
    while !rest.is_empty() {
        match rustix::io::write(target, rest) {
            Ok(written @ 1..) => rest = &rest[written.min(rest.len())..],
            Ok(0) | Err(_) => return,
        }
    }
}

/// Ends the process with [`TIMEOUT_EXIT`] when a run outlives its deadline by `grace`: the
/// engine's epoch deadline interrupts guest code, but not a guest blocked in a host call (a
/// WASI sleep), which only this can end. Armed for each run, disarmed after it. Its report
/// is written from a thread of its own, and the process ends [`REPORT_GRACE`] later whether
/// the report got out or not: a guest cannot hold it by holding a stream.
pub struct Watchdog {
    state: Arc<(Mutex<Armed>, Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    /// Starts the watchdog; `report` is called (with the time that passed) just before the
    /// process ends.
    pub fn start(report: impl Fn(Duration) + Send + Sync + 'static) -> std::io::Result<Self> {
        let report = Arc::new(report);
        let state = Arc::new((
            Mutex::new(Armed {
                until: None,
                done: false,
            }),
            Condvar::new(),
        ));
        let watched = Arc::clone(&state);
        let started = Instant::now();
        let thread = std::thread::Builder::new()
            .name("twm-watchdog".into())
            .spawn(move || {
                let (lock, wake) = &*watched;
                let mut armed = lock.lock().unwrap_or_else(PoisonError::into_inner);
                while !armed.done {
                    armed = match armed.until {
                        Some(until) if Instant::now() >= until => {
                            let elapsed = started.elapsed();
                            let report = Arc::clone(&report);
                            let writer = std::thread::Builder::new()
                                .name("twm-watchdog-report".into())
                                .spawn(move || report(elapsed));
                            if let Ok(writer) = writer {
                                let deadline = Instant::now() + REPORT_GRACE;
                                while !writer.is_finished() && Instant::now() < deadline {
                                    std::thread::sleep(Duration::from_millis(5));
                                }
                            }
                            std::process::exit(i32::from(TIMEOUT_EXIT));
                        }
                        Some(until) => {
                            let left = until.saturating_duration_since(Instant::now());
                            wake.wait_timeout(armed, left)
                                .unwrap_or_else(PoisonError::into_inner)
                                .0
                        }
                        None => wake.wait(armed).unwrap_or_else(PoisonError::into_inner),
                    };
                }
            })?;
        Ok(Self {
            state,
            thread: Some(thread),
        })
    }

    /// Arms it to fire `after` from now (replacing any earlier arming).
    pub fn arm(&self, after: Duration) {
        self.set(Some(Instant::now() + after));
    }

    /// Disarms it.
    pub fn disarm(&self) {
        self.set(None);
    }

    fn set(&self, until: Option<Instant>) {
        let (lock, wake) = &*self.state;
        lock.lock().unwrap_or_else(PoisonError::into_inner).until = until;
        wake.notify_all();
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        let (lock, wake) = &*self.state;
        lock.lock().unwrap_or_else(PoisonError::into_inner).done = true;
        wake.notify_all();
        if let Some(thread) = self.thread.take() {
            // It only waits; nothing is left to clean up if it failed.
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        for bad in [
            "",
            "s",
            "-1s",
            "0",
            "1us",
            "25h",
            "1e9",
            "1 fortnight",
            "NaN",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn ticks() {
        assert_eq!(tick_for(Duration::from_millis(5)), Duration::from_millis(1));
        assert_eq!(
            tick_for(Duration::from_millis(200)),
            Duration::from_millis(20)
        );
        assert_eq!(
            tick_for(Duration::from_secs(60)),
            Duration::from_millis(100)
        );
    }
}
