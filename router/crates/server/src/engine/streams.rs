//! The requests one actor serves, as streams of events to their clients: each request's
//! incremental detokenizer and stop strings, the fan-out of a step's sampled tokens to their
//! receivers, the last event (`Finished` or `Error`), and the latency histograms observed as
//! those events happen. [`Streams`] also keeps the handle's count of outstanding requests.
//!
//! What the scheduler decided (EOS or a `stop_token_ids` token, length) arrives with each token;
//! stop strings are decided here (not before `min_tokens` output tokens, as vLLM's stop checker).
//! The text of a `stop_token_ids` token that ended a request is not emitted (vLLM). The caller
//! tells the scheduler about stop-string ends ([`Ended::stopped`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use deltaserve_ipc::wire::{PromptLogprob, RequestOutput, SamplingParams};
use deltaserve_sched::{FinishReason as SchedFinish, SeqUpdate};
use tokio::sync::mpsc;

use super::metrics::RequestLatency;
use super::{FinishReason, GenerateEvent, GenerateRequest};
use crate::text::detok::{DetokStream, StepText};
use crate::text::tokenizer::TextTokenizer;

/// A request this actor owns.
struct Live {
    /// Where the request's events go; closed when the client went away.
    events: mpsc::UnboundedSender<GenerateEvent>,
    /// Incremental detokenizer with the request's stop strings.
    detok: DetokStream,
    /// Sampling parameters, sent with the request whenever it is (re)sent in full.
    sampling: SamplingParams,
    /// Prompt length, for usage.
    prompt_tokens: u32,
    /// Tokens generated so far, for usage.
    completion_tokens: u32,
    /// When the engine accepted it.
    arrived: Instant,
    /// When its first token was sent; `None` before.
    first_token_at: Option<Instant>,
    /// Whether a step has scheduled it yet (its queue time is observed once).
    scheduled: bool,
    /// Its variant (0: the base model).
    variant_id: u32,
    /// Its `stop_token_ids` (their text is not emitted when one ends it).
    stop_token_ids: Vec<u32>,
    /// With `sampling.prompt_logprobs`: the prompt tokens' logprobs received so far (positions
    /// 1.. in order; a recomputed chunk's repeats are dropped), sent before the first token.
    prompt_logprobs: Vec<PromptLogprob>,
}

/// A request that a step's tokens ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Ended {
    pub id: u64,
    pub reason: FinishReason,
    /// Ended by a stop string: the scheduler does not know yet.
    pub stopped: bool,
}

/// The live requests of one actor.
pub(super) struct Streams {
    live: BTreeMap<u64, Live>,
    tokenizer: Arc<TextTokenizer>,
    /// Requests handed to the actor and not yet ended (the handle's load-balancing signal).
    outstanding: Arc<AtomicUsize>,
    latency: RequestLatency,
}

impl Streams {
    pub fn new(
        tokenizer: Arc<TextTokenizer>,
        outstanding: Arc<AtomicUsize>,
        latency: RequestLatency,
    ) -> Self {
        Self {
            live: BTreeMap::new(),
            tokenizer,
            outstanding,
            latency,
        }
    }

    /// The shared latency histograms.
    pub fn latency(&self) -> &RequestLatency {
        &self.latency
    }

    /// Starts streaming request `id` (already accepted by the scheduler).
    pub fn open(
        &mut self,
        id: u64,
        req: GenerateRequest,
        events: mpsc::UnboundedSender<GenerateEvent>,
        arrived: Instant,
    ) {
        let detok = DetokStream::new(self.tokenizer.clone(), &req.prompt_token_ids, req.stop)
            .with_min_tokens(req.sampling.min_tokens);
        let live = Live {
            events,
            detok,
            sampling: req.sampling,
            prompt_tokens: req.prompt_token_ids.len() as u32,
            completion_tokens: 0,
            arrived,
            first_token_at: None,
            scheduled: false,
            variant_id: req.adapter_id,
            stop_token_ids: req.stop_token_ids,
            prompt_logprobs: Vec::new(),
        };
        self.live.insert(id, live);
    }

    /// Refuses a request that never became live: its only event is an `Error`.
    pub fn refuse(&self, events: mpsc::UnboundedSender<GenerateEvent>, message: String) {
        let _ = events.send(GenerateEvent::Error { message });
        self.outstanding.fetch_sub(1, Ordering::Relaxed);
    }

    pub fn contains(&self, id: u64) -> bool {
        self.live.contains_key(&id)
    }

    /// Every live id.
    pub fn ids(&self) -> Vec<u64> {
        self.live.keys().copied().collect()
    }

    /// Live ids of requests for `variant_id`.
    pub fn ids_of_variant(&self, variant_id: u32) -> Vec<u64> {
        self.live
            .iter()
            .filter(|(_, l)| l.variant_id == variant_id)
            .map(|(id, _)| *id)
            .collect()
    }

    /// Ids no step has scheduled yet that have waited longer than `wait` since the engine
    /// accepted them (S-LoRA's early abort: their first token can no longer come in time).
    pub fn queued_longer_than(&self, wait: std::time::Duration) -> Vec<u64> {
        self.live
            .iter()
            .filter(|(_, l)| !l.scheduled && l.arrived.elapsed() > wait)
            .map(|(id, _)| *id)
            .collect()
    }

    /// Ids whose client went away (receiver dropped).
    pub fn abandoned(&self) -> Vec<u64> {
        self.live
            .iter()
            .filter(|(_, l)| l.events.is_closed())
            .map(|(id, _)| *id)
            .collect()
    }

    /// Request `id`'s sampling parameters (defaults for an unknown id).
    pub fn sampling(&self, id: u64) -> SamplingParams {
        self.live
            .get(&id)
            .map(|l| l.sampling.clone())
            .unwrap_or_default()
    }

    /// A step scheduled `id` in full: the first time, its queue time is observed and the
    /// answer is true (it left the admission queue).
    pub fn scheduled(&mut self, id: u64) -> bool {
        if let Some(live) = self.live.get_mut(&id) {
            if !live.scheduled {
                live.scheduled = true;
                self.latency
                    .request_queue_time
                    .observe(live.arrived.elapsed().as_secs_f64());
                return true;
            }
        }
        false
    }

    /// The prompt length of `id` while it is live and no step has scheduled it yet (it still
    /// counts in the admission queue).
    pub fn queued_prompt_tokens(&self, id: u64) -> Option<u32> {
        self.live
            .get(&id)
            .filter(|l| !l.scheduled)
            .map(|l| l.prompt_tokens)
    }

    /// Streams a step's tokens (`updates`, from the scheduler, with `outputs`' logprobs) to
    /// their clients: detokenized, stop strings held back and applied. Returns how many tokens
    /// went to live requests and which requests they ended (not yet closed: see [`Self::end`]).
    pub fn stream(
        &mut self,
        updates: Vec<SeqUpdate>,
        outputs: &[RequestOutput],
    ) -> (u64, Vec<Ended>) {
        let by_id: HashMap<u64, &RequestOutput> = outputs.iter().map(|o| (o.req_id, o)).collect();
        for o in outputs.iter().filter(|o| !o.prompt_logprobs.is_empty()) {
            if let Some(live) = self.live.get_mut(&o.req_id) {
                for p in &o.prompt_logprobs {
                    if p.position as usize == live.prompt_logprobs.len() + 1 {
                        live.prompt_logprobs.push(p.clone());
                    }
                }
            }
        }
        let mut tokens = 0;
        let mut ended = Vec::new();
        for u in updates {
            let Some(live) = self.live.get_mut(&u.id) else {
                continue;
            };
            live.completion_tokens += 1;
            tokens += 1;
            let stop_token =
                u.finished == Some(SchedFinish::Eos) && live.stop_token_ids.contains(&u.token);
            let step_text = if stop_token {
                StepText::default()
            } else {
                live.detok.push(u.token)
            };
            let mut text = step_text.delta;
            let reason = if step_text.stopped {
                Some(FinishReason::Stop)
            } else {
                match u.finished {
                    Some(SchedFinish::Eos) => Some(FinishReason::Stop),
                    Some(SchedFinish::Length) => Some(FinishReason::Length),
                    None => None,
                }
            };
            if reason.is_some() && !step_text.stopped {
                text.push_str(&live.detok.flush());
            }
            let (logprob, top_logprobs) = match by_id.get(&u.id) {
                Some(o) => (o.logprob, o.top_logprobs.clone()),
                None => (None, Vec::new()),
            };
            if live.first_token_at.is_none() && live.sampling.prompt_logprobs.is_some() {
                let logprobs = std::mem::take(&mut live.prompt_logprobs);
                let _ = live.events.send(GenerateEvent::PromptLogprobs { logprobs });
            }
            let _ = live.events.send(GenerateEvent::Token {
                token_id: u.token,
                text,
                logprob,
                top_logprobs,
            });
            if live.first_token_at.is_none() {
                let now = Instant::now();
                live.first_token_at = Some(now);
                self.latency
                    .time_to_first_token
                    .observe((now - live.arrived).as_secs_f64());
            }
            if let Some(reason) = reason {
                ended.push(Ended {
                    id: u.id,
                    reason,
                    stopped: step_text.stopped,
                });
            }
        }
        (tokens, ended)
    }

    /// Ends request `id`: a `Finished` event (`Some(reason)`, observing its end-to-end time and
    /// time per output token), or silently when the client is gone. False if it was not live.
    pub fn end(&mut self, id: u64, reason: Option<FinishReason>) -> bool {
        let Some(live) = self.live.remove(&id) else {
            return false;
        };
        if let Some(reason) = reason {
            let _ = live.events.send(GenerateEvent::Finished {
                reason,
                prompt_tokens: live.prompt_tokens,
                completion_tokens: live.completion_tokens,
            });
            self.latency.request_finished(
                live.arrived.elapsed(),
                live.first_token_at.map(|t| t - live.arrived),
                live.completion_tokens,
            );
        }
        self.outstanding.fetch_sub(1, Ordering::Relaxed);
        true
    }

    /// Ends request `id` with an `Error` event. False if it was not live.
    pub fn fail(&mut self, id: u64, message: String) -> bool {
        let Some(live) = self.live.remove(&id) else {
            return false;
        };
        let _ = live.events.send(GenerateEvent::Error { message });
        self.outstanding.fetch_sub(1, Ordering::Relaxed);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::test_support::tiny_tokenizer;

    fn request(stop: &[&str]) -> GenerateRequest {
        GenerateRequest {
            prompt_token_ids: vec![104, 105],
            max_tokens: 4,
            sampling: SamplingParams::default(),
            stop: stop.iter().map(|s| s.to_string()).collect(),
            ignore_eos: false,
            adapter_id: 0,
            stop_token_ids: vec![],
        }
    }

    fn token(id: u64, token: u32, finished: Option<SchedFinish>) -> SeqUpdate {
        SeqUpdate {
            id,
            token,
            finished,
        }
    }

    fn drain(rx: &mut mpsc::UnboundedReceiver<GenerateEvent>) -> Vec<GenerateEvent> {
        std::iter::from_fn(|| rx.try_recv().ok()).collect()
    }

    #[test]
    fn only_unscheduled_requests_past_the_wait_are_expired() {
        let outstanding = Arc::new(AtomicUsize::new(3));
        let mut streams = Streams::new(tiny_tokenizer(), outstanding, Default::default());
        let long_ago = Instant::now() - std::time::Duration::from_millis(500);
        let mut keep = Vec::new();
        for (id, arrived) in [(1, long_ago), (2, long_ago), (3, Instant::now())] {
            let (tx, rx) = mpsc::unbounded_channel();
            keep.push(rx);
            streams.open(id, request(&[]), tx, arrived);
        }
        assert!(streams.scheduled(2), "2 left the queue");
        let wait = std::time::Duration::from_millis(100);
        assert_eq!(streams.queued_longer_than(wait), vec![1]);
        assert!(streams
            .queued_longer_than(std::time::Duration::from_secs(5))
            .is_empty());
    }

    #[test]
    fn events_fan_out_and_latencies_are_observed_as_they_happen() {
        let outstanding = Arc::new(AtomicUsize::new(3));
        let mut streams = Streams::new(
            tiny_tokenizer(),
            outstanding.clone(),
            RequestLatency::default(),
        );
        let (tx_a, mut rx_a) = mpsc::unbounded_channel();
        let (tx_b, mut rx_b) = mpsc::unbounded_channel();
        let (tx_c, mut rx_c) = mpsc::unbounded_channel();
        streams.open(1, request(&[]), tx_a, Instant::now());
        streams.open(2, request(&["i"]), tx_b, Instant::now());
        streams.refuse(tx_c, "no".into());
        assert!(matches!(
            drain(&mut rx_c)[..],
            [GenerateEvent::Error { .. }]
        ));
        assert_eq!(outstanding.load(Ordering::Relaxed), 2);

        streams.scheduled(1);
        streams.scheduled(1);
        streams.scheduled(2);
        let latency = streams.latency().clone();
        assert_eq!(
            latency.request_queue_time.get_sample_count(),
            2,
            "once each"
        );

        let (tokens, ended) = streams.stream(vec![token(1, 104, None), token(2, 104, None)], &[]);
        assert_eq!((tokens, ended.len()), (2, 0));
        assert_eq!(latency.time_to_first_token.get_sample_count(), 2);
        let (tokens, ended) = streams.stream(
            vec![
                token(1, 105, Some(SchedFinish::Length)),
                token(2, 105, None),
                token(9, 105, None),
            ],
            &[],
        );
        assert_eq!(tokens, 2, "id 9 is not live");
        assert_eq!(
            ended,
            vec![
                Ended {
                    id: 1,
                    reason: FinishReason::Length,
                    stopped: false
                },
                Ended {
                    id: 2,
                    reason: FinishReason::Stop,
                    stopped: true
                }
            ]
        );
        assert_eq!(latency.time_to_first_token.get_sample_count(), 2);

        assert!(streams.end(1, Some(FinishReason::Length)));
        assert!(!streams.end(1, Some(FinishReason::Length)), "already ended");
        let a = drain(&mut rx_a);
        let texts: Vec<&str> = a
            .iter()
            .filter_map(|e| match e {
                GenerateEvent::Token { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(texts.concat(), "hi");
        assert!(matches!(
            a.last(),
            Some(GenerateEvent::Finished {
                reason: FinishReason::Length,
                prompt_tokens: 2,
                completion_tokens: 2
            })
        ));
        assert_eq!(latency.e2e_request_latency.get_sample_count(), 1);
        assert_eq!(latency.time_per_output_token.get_sample_count(), 1);

        // The stop string is never emitted; a failed request gets an Error and no latency.
        assert!(streams.fail(2, "boom".into()));
        let b = drain(&mut rx_b);
        let text: String = b
            .iter()
            .filter_map(|e| match e {
                GenerateEvent::Token { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(text, "h");
        assert!(matches!(b.last(), Some(GenerateEvent::Error { .. })));
        assert_eq!(latency.e2e_request_latency.get_sample_count(), 1);
        assert_eq!(outstanding.load(Ordering::Relaxed), 0);
        assert!(streams.ids().is_empty());
    }

    fn texts(events: &[GenerateEvent]) -> String {
        events
            .iter()
            .filter_map(|e| match e {
                GenerateEvent::Token { text, .. } => Some(text.as_str()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_stop_token_id_ends_without_its_text_and_stop_strings_wait_for_min_tokens() {
        let mut streams = Streams::new(
            tiny_tokenizer(),
            Arc::new(AtomicUsize::new(2)),
            Default::default(),
        );
        let (tx_a, mut rx_a) = mpsc::unbounded_channel();
        let (tx_b, mut rx_b) = mpsc::unbounded_channel();
        // 104 = "h", 105 = "i" in the tiny tokenizer. The scheduler ends a request on a stop
        // token id with Eos; a token that ends it by length keeps its text.
        let mut a = request(&[]);
        a.stop_token_ids = vec![105];
        streams.open(1, a, tx_a, Instant::now());
        let mut b = request(&["h"]);
        b.sampling.min_tokens = 2;
        streams.open(2, b, tx_b, Instant::now());
        let (_, ended) = streams.stream(vec![token(1, 104, None), token(2, 104, None)], &[]);
        assert!(
            ended.is_empty(),
            "{ended:?}: the stop string waits for min_tokens"
        );
        let (_, ended) = streams.stream(
            vec![token(1, 105, Some(SchedFinish::Eos)), token(2, 104, None)],
            &[],
        );
        let reasons: Vec<_> = ended.iter().map(|e| (e.id, e.reason, e.stopped)).collect();
        assert_eq!(
            reasons,
            vec![
                (1, FinishReason::Stop, false),
                (2, FinishReason::Stop, true)
            ]
        );
        assert_eq!(
            texts(&drain(&mut rx_a)),
            "h",
            "the stop token's text is not emitted"
        );
        assert_eq!(
            texts(&drain(&mut rx_b)),
            "h",
            "the first h came before min_tokens"
        );
    }

    #[test]
    fn prompt_logprobs_come_once_before_the_first_token_without_repeats() {
        use deltaserve_ipc::wire::PromptLogprob;
        let mut streams = Streams::new(
            tiny_tokenizer(),
            Arc::new(AtomicUsize::new(1)),
            Default::default(),
        );
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut req = request(&[]);
        req.prompt_token_ids = vec![104, 105, 106];
        req.sampling.prompt_logprobs = Some(0);
        streams.open(3, req, tx, Instant::now());
        let output = |positions: &[u32]| RequestOutput {
            req_id: 3,
            prompt_logprobs: positions
                .iter()
                .map(|&position| PromptLogprob {
                    position,
                    logprob: -(position as f64),
                    top_logprobs: vec![],
                })
                .collect(),
            ..Default::default()
        };
        // A first chunk, the same chunk again (recomputed after a preemption), then the rest
        // with the first token.
        streams.stream(vec![], &[output(&[1])]);
        streams.stream(vec![], &[output(&[1])]);
        streams.stream(vec![token(3, 104, None)], &[output(&[2])]);
        streams.stream(vec![token(3, 105, None)], &[]);
        let events = drain(&mut rx);
        let GenerateEvent::PromptLogprobs { logprobs } = &events[0] else {
            panic!("{events:?}")
        };
        let positions: Vec<_> = logprobs.iter().map(|p| p.position).collect();
        assert_eq!(positions, [1, 2]);
        assert!(matches!(
            events[1],
            GenerateEvent::Token { token_id: 104, .. }
        ));
        assert_eq!(events.len(), 3, "sent once: {events:?}");
    }

    #[test]
    fn a_dropped_receiver_marks_the_request_abandoned() {
        let outstanding = Arc::new(AtomicUsize::new(1));
        let mut streams = Streams::new(tiny_tokenizer(), outstanding.clone(), Default::default());
        let (tx, rx) = mpsc::unbounded_channel();
        streams.open(5, request(&[]), tx, Instant::now());
        assert!(streams.abandoned().is_empty());
        drop(rx);
        assert_eq!(streams.abandoned(), vec![5]);
        assert!(streams.end(5, None));
        assert_eq!(outstanding.load(Ordering::Relaxed), 0);
    }
}
