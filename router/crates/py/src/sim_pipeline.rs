//! When a simulated worker's steps run and answer: the worker loop's overlapped pipeline
//! (`pyworker/deltaserve/worker/loop.py`) on the virtual clock, with the worker's host (its one
//! Python thread) and the device as two resources.
//!
//! # The worker loop, as timed here
//!
//! ```text
//! plan K arrives at a = sent + router_gap
//!   launch_start = max(a, host_free)             the thread is free once its last send is done
//!   launch_end   = launch_start + host_s(K)      decode, checks, batch build, kernel launches
//!   device_start = max(launch_start, device_free, host copies K's ToGpu ops wait for)
//!   device_end   = max(device_start + device_s(K), launch_end)   (kernels run as they are
//!                                                  launched; the last cannot end before it is)
//! the step P before K, on the device and not answered yet:
//!   a < P.device_end  the loop received K while P ran: it launches K, then answers P, so
//!                     P's output leaves at max(P.device_end, launch_end)
//!   otherwise         P was answered at its device end, before K came
//! K's output leaves at its device end, or later when the plan after it postpones it (above)
//! host_free = the later of launch_end and the postponed output
//! ```
//!
//! With `host_s` = 0 every output leaves at its step's device end and a step starts at
//! `max(a, device_free)`: the simulator's timing before host time was modelled.

/// The two resources of one worker.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct WorkerClock {
    /// When the worker's thread is free to receive and launch the next plan.
    pub(crate) host_free_s: f64,
    /// When the device finishes the last step launched.
    pub(crate) device_free_s: f64,
}

/// The step before the one launched, still on the device or not answered yet.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Previous {
    /// When its device work ends.
    pub(crate) device_end_s: f64,
    /// When its output leaves the worker, as known so far.
    pub(crate) out_s: f64,
}

/// The times of one launched step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Launched {
    /// When its device work starts.
    pub(crate) device_start_s: f64,
    /// When its device work ends (its output leaves then unless a later launch postpones it).
    pub(crate) device_end_s: f64,
    /// The previous step's output time when this launch postponed it.
    pub(crate) previous_out_s: Option<f64>,
}

impl WorkerClock {
    /// Launches a step whose plan arrives at `arrive_s`, with `host_s` of launch work and
    /// `device_s` of device work that cannot start before `ready_s` (its host copies), behind
    /// `previous` (module docstring).
    pub(crate) fn launch(
        &mut self,
        arrive_s: f64,
        host_s: f64,
        device_s: f64,
        ready_s: f64,
        previous: Option<Previous>,
    ) -> Launched {
        let launch_start = arrive_s.max(self.host_free_s);
        let launch_end = launch_start + host_s;
        let device_start = launch_start.max(self.device_free_s).max(ready_s);
        let device_end = (device_start + device_s).max(launch_end);
        let previous_out_s = previous
            .filter(|p| arrive_s < p.device_end_s)
            .map(|p| p.out_s.max(p.device_end_s).max(launch_end))
            .filter(|&out| previous.is_some_and(|p| out > p.out_s));
        self.device_free_s = device_end;
        self.host_free_s = launch_end.max(previous_out_s.unwrap_or(launch_end));
        Launched {
            device_start_s: device_start,
            device_end_s: device_end,
            previous_out_s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn without_host_time_a_step_starts_at_max_of_arrival_and_device_free() {
        let mut c = WorkerClock::default();
        let first = c.launch(1.0, 0.0, 0.010, 0.0, None);
        assert!(close(first.device_start_s, 1.0) && close(first.device_end_s, 1.010));
        let prev = Previous {
            device_end_s: first.device_end_s,
            out_s: first.device_end_s,
        };
        let second = c.launch(1.002, 0.0, 0.010, 0.0, Some(prev));
        assert!(close(second.device_start_s, 1.010), "behind the first");
        assert_eq!(second.previous_out_s, None, "nothing postponed");
        let late = c.launch(2.0, 0.0, 0.010, 2.5, None);
        assert!(close(late.device_start_s, 2.5), "waits for its host copies");
    }

    #[test]
    fn a_launch_received_while_the_previous_step_runs_postpones_its_output() {
        let mut c = WorkerClock::default();
        let p = c.launch(0.0, 0.001, 0.010, 0.0, None);
        assert!(close(p.device_end_s, 0.010));
        let prev = Previous {
            device_end_s: p.device_end_s,
            out_s: p.device_end_s,
        };
        // An eager step whose launch (15 ms) outlasts the previous step's device work.
        let k = c.launch(0.002, 0.015, 0.004, 0.0, Some(prev));
        assert!(
            close(k.previous_out_s.unwrap(), 0.017),
            "answered after K's launch"
        );
        assert!(close(k.device_start_s, 0.010));
        assert!(
            close(k.device_end_s, 0.017),
            "its kernels run as they are launched"
        );
        assert!(close(c.host_free_s, 0.017));
        // A plan that comes after the device finished changes nothing before it.
        let prev = Previous {
            device_end_s: k.device_end_s,
            out_s: k.device_end_s,
        };
        let j = c.launch(0.030, 0.001, 0.005, 0.0, Some(prev));
        assert_eq!(j.previous_out_s, None);
        assert!(close(j.device_start_s, 0.030) && close(j.device_end_s, 0.035));
    }
}
