//! Wake-ups for waiters (see [Waiting](super#waiting)): one subscriber connection per backend,
//! opened on the first wait, subscribed to the channel of each key a waiter of this backend
//! watches (the channel is named as the lock key), and fanning each message out to the
//! key's watchers.
//!
//! One task, the driver, owns the connection: it connects (again, after a drop), subscribes and
//! unsubscribes channels to match the keys watched, and delivers messages. Watchers see a
//! [`Signal`] per channel: its `wakes` count goes up at each message, and `live` says whether
//! the channel is subscribed on a connection right now. Any change of the signal wakes them:
//! a message, a dropped connection (they then poll with backoff), a resubscription after a
//! reconnection (they try again at once, since messages may have been missed meanwhile).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use redis::aio::{PubSubSink, PubSubStream};
use redis::{ErrorKind, ServerErrorKind};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::commands::ClientSlot;
use super::fair::HoldOffs;
use crate::backend::{BoxFuture, ReleaseWatch};

/// What the watchers of one channel see.
#[derive(Debug, Clone, Copy, Default)]
struct Signal {
    /// Messages received on the channel (and resubscriptions, which may follow missed ones).
    wakes: u64,
    /// The channel is subscribed on the current connection.
    live: bool,
}

struct Entry {
    signal: watch::Sender<Signal>,
    watchers: usize,
}

#[derive(Default)]
struct Registry {
    channels: HashMap<Arc<[u8]>, Entry>,
    /// Channels to move to the back of the server's delivery order (see [`Wakes::to_back`]).
    to_back: HashSet<Arc<[u8]>>,
    /// Channels to subscribe or unsubscribe, to the driver; `None` while no driver runs.
    driver: Option<mpsc::UnboundedSender<Arc<[u8]>>>,
}

/// The longest pause between two connection attempts of the driver.
const MAX_RECONNECT_PAUSE: Duration = Duration::from_secs(5);
/// The first pause after a failed connection attempt.
const FIRST_RECONNECT_PAUSE: Duration = Duration::from_millis(50);
/// How long the driver keeps its connection with no key watched before it closes it.
const IDLE: Duration = Duration::from_secs(60);

/// The wake-ups of one backend.
pub(crate) struct Wakes {
    registry: Mutex<Registry>,
    /// What the subscriber connects with (read again at each connection, so that behind
    /// Sentinel it follows the master); `None` for a backend on a connection manager the
    /// application passed in (its waiters poll).
    client: Option<ClientSlot>,
    timeout: Duration,
    /// Set for good when the server refused `SUBSCRIBE` (no `+subscribe`, or no channel
    /// permission): waiters then poll.
    refused: AtomicBool,
    /// Cancelled when the backend is dropped: the driver ends.
    closed: CancellationToken,
    /// What a release by another backend ends (see [`Heard`]); `None` with `fair_waits=false`.
    heard: Option<Heard>,
}

/// What a subscriber does when it hears a release of another backend: the key changed hands
/// since this backend's own release, so this backend's hold-off on the key (see
/// [Fair waiting](super#fair-waiting)) has done its work and ends, and its waiters try at once
/// with the others. Without this, backends that took a key in turn held each other off, and
/// a release woke only waiters that were all holding off.
#[derive(Clone)]
pub(crate) struct Heard {
    /// This backend's announcer id (the message of its own releases).
    pub(crate) own: Arc<[u8]>,
    pub(crate) hold_offs: Arc<HoldOffs>,
}

impl std::fmt::Debug for Wakes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wakes")
            .field("refused", &self.refused.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Wakes {
    pub(crate) fn new(
        client: Option<ClientSlot>,
        timeout: Duration,
        heard: Option<Heard>,
    ) -> Wakes {
        Wakes {
            registry: Mutex::default(),
            client,
            timeout,
            refused: AtomicBool::new(false),
            closed: CancellationToken::new(),
            heard,
        }
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Ends the driver (the backend is gone).
    pub(crate) fn shut_down(&self) {
        self.closed.cancel();
    }

    /// Whether wake-ups can be had at all.
    fn available(&self) -> bool {
        self.client.is_some() && !self.refused.load(Ordering::Relaxed)
    }

    /// Starts watching `channel`: registers it, makes sure a driver runs (on this runtime if
    /// none does), and waits (up to the command timeout) until the channel is subscribed or
    /// the attempt failed. `None` when wake-ups are not available.
    pub(crate) async fn watch(self: &Arc<Self>, channel: &[u8]) -> Option<Box<dyn ReleaseWatch>> {
        if !self.available() {
            return None;
        }
        let channel: Arc<[u8]> = Arc::from(channel);
        let mut receiver = {
            let mut registry = self.registry();
            let entry = registry
                .channels
                .entry(Arc::clone(&channel))
                .or_insert_with(|| Entry {
                    signal: watch::channel(Signal::default()).0,
                    watchers: 0,
                });
            entry.watchers += 1;
            let receiver = entry.signal.subscribe();
            if !receiver.borrow().live {
                self.request(&mut registry, &channel);
            }
            receiver
        };
        let watch = RedisWatch {
            wakes: Arc::clone(self),
            channel,
            receiver: receiver.clone(),
        };
        if !receiver.borrow_and_update().live {
            // Until the driver has subscribed the channel, or failed to.
            let _ = tokio::time::timeout(self.timeout, receiver.changed()).await;
        }
        Some(Box::new(watch))
    }

    /// Asks the driver to bring `channel` in line with the registry, starting a driver on the
    /// current runtime when none runs (a new one subscribes every channel watched).
    fn request(self: &Arc<Self>, registry: &mut Registry, channel: &Arc<[u8]>) {
        if let Some(driver) = &registry.driver
            && driver.send(Arc::clone(channel)).is_ok()
        {
            return;
        }
        registry.driver = None;
        if !self.available() || self.closed.is_cancelled() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (sender, receiver) = mpsc::unbounded_channel();
        registry.driver = Some(sender);
        let wakes = Arc::clone(self);
        drop(runtime.spawn(drive(wakes, receiver)));
    }

    /// Makes sure a driver runs while `channel` is watched (after the runtime of the last one
    /// shut down, say).
    fn keep_driven(self: &Arc<Self>, channel: &Arc<[u8]>) {
        let mut registry = self.registry();
        let running = registry
            .driver
            .as_ref()
            .is_some_and(|driver| !driver.is_closed());
        if !running {
            self.request(&mut registry, channel);
        }
    }

    /// Marks every channel not live (the connection is gone), waking its watchers.
    fn all_down(&self) {
        for entry in self.registry().channels.values() {
            entry.signal.send_modify(|signal| signal.live = false);
        }
    }

    /// A message on `channel`.
    fn wake(&self, channel: &[u8]) {
        if let Some(entry) = self.registry().channels.get(channel) {
            entry
                .signal
                .send_modify(|signal| signal.wakes = signal.wakes.wrapping_add(1));
        }
    }

    /// Whether `channel` is watched and subscribed on the current connection.
    pub(crate) fn live(&self, channel: &[u8]) -> bool {
        self.registry()
            .channels
            .get(channel)
            .is_some_and(|entry| entry.signal.borrow().live)
    }

    /// Whether `channel` is watched.
    pub(crate) fn wanted(&self, channel: &[u8]) -> bool {
        self.registry().channels.contains_key(channel)
    }

    /// `channel` is subscribed: live, and a wake-up (a release may have come before).
    fn up(&self, channel: &[u8]) {
        if let Some(entry) = self.registry().channels.get(channel) {
            entry.signal.send_modify(|signal| {
                signal.live = true;
                signal.wakes = signal.wakes.wrapping_add(1);
            });
        }
    }

    fn watched(&self) -> Vec<Arc<[u8]>> {
        self.registry().channels.keys().cloned().collect()
    }

    /// A waiter of this backend took the key of `channel`: if the channel stays watched (by a
    /// local waiter queued behind it), the driver subscribes it again, which puts this
    /// connection at the back of the server's list of the channel's subscribers. The server
    /// delivers a message to subscribers in that order, so without this the backend that
    /// subscribed first heard every release first and won most races for the key (with four
    /// processes, one took 23 % more than an equal share). The watchers are woken once the
    /// channel is subscribed again, as after a reconnection.
    pub(crate) fn to_back(self: &Arc<Self>, channel: &[u8]) {
        let mut registry = self.registry();
        let Some((channel, _)) = registry.channels.get_key_value(channel) else {
            return;
        };
        let channel = Arc::clone(channel);
        if let Some(driver) = &registry.driver
            && driver.send(Arc::clone(&channel)).is_ok()
        {
            registry.to_back.insert(channel);
        }
    }

    /// Whether `channel` was to go to the back of the delivery order, forgetting it.
    fn take_to_back(&self, channel: &[u8]) -> bool {
        let mut registry = self.registry();
        !registry.to_back.is_empty() && registry.to_back.remove(channel)
    }

    /// A watcher of `channel` is gone.
    fn unwatch(self: &Arc<Self>, channel: &Arc<[u8]>) {
        let mut registry = self.registry();
        let Some(entry) = registry.channels.get_mut(channel) else {
            return;
        };
        entry.watchers -= 1;
        if entry.watchers == 0 {
            registry.channels.remove(channel);
            registry.to_back.remove(channel);
            if let Some(driver) = &registry.driver {
                let _ = driver.send(Arc::clone(channel));
            }
        }
    }
}

/// Marks every channel down when the driver ends, for any reason (its runtime shutting down
/// included), so that watchers poll, and the next watcher starts another driver.
struct DriverGone(Arc<Wakes>);

impl Drop for DriverGone {
    fn drop(&mut self) {
        self.0.registry().driver = None;
        self.0.all_down();
    }
}

/// Why a connection's session ended.
enum Ended {
    /// Reconnect.
    Dropped,
    /// Stop: the backend is gone, the server refused the subscription, or nothing was watched
    /// for a while.
    Stop,
}

async fn drive(wakes: Arc<Wakes>, mut requests: mpsc::UnboundedReceiver<Arc<[u8]>>) {
    let _gone = DriverGone(Arc::clone(&wakes));
    let Some(slot) = wakes.client.clone() else {
        return;
    };
    let mut pause = FIRST_RECONNECT_PAUSE;
    loop {
        let current = slot
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
            .map(|(client, _)| client.clone());
        let Some(client) = current else {
            return;
        };
        let connecting = tokio::time::timeout(wakes.timeout, client.get_async_pubsub());
        let connected = tokio::select! {
            () = wakes.closed.cancelled() => return,
            connected = connecting => connected,
        };
        match connected {
            Ok(Ok(pubsub)) => {
                pause = FIRST_RECONNECT_PAUSE;
                let (sink, stream) = pubsub.split();
                match session(&wakes, sink, stream, &mut requests).await {
                    Ended::Stop => return,
                    Ended::Dropped => {
                        wakes.all_down();
                        tracing::debug!("the redis subscriber connection dropped; reconnecting");
                    }
                }
            }
            Ok(Err(err)) => {
                tracing::debug!(error = %err, "the redis subscriber could not connect; waiters poll meanwhile");
            }
            Err(_) => {
                tracing::debug!(
                    "the redis subscriber timed out connecting; waiters poll meanwhile"
                );
            }
        }
        if wakes.watched().is_empty() {
            return;
        }
        tokio::select! {
            () = wakes.closed.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(MAX_RECONNECT_PAUSE);
    }
}

/// One connection's life: subscribes what is watched, then follows messages and requests.
async fn session(
    wakes: &Wakes,
    mut sink: PubSubSink,
    mut stream: PubSubStream,
    requests: &mut mpsc::UnboundedReceiver<Arc<[u8]>>,
) -> Ended {
    use futures_util::StreamExt as _;
    let mut subscribed: HashSet<Arc<[u8]>> = HashSet::new();
    for channel in wakes.watched() {
        if let Some(ended) = reconcile(wakes, &mut sink, &mut subscribed, channel).await {
            return ended;
        }
    }
    loop {
        let idle = subscribed.is_empty();
        tokio::select! {
            () = wakes.closed.cancelled() => return Ended::Stop,
            message = stream.next() => match message {
                Some(message) => {
                    if let Ok(channel) = message.get_channel::<Vec<u8>>() {
                        if let Some(heard) = &wakes.heard
                            && message.get_payload_bytes() != &heard.own[..]
                        {
                            heard.hold_offs.end(&channel);
                        }
                        wakes.wake(&channel);
                    }
                }
                None => return Ended::Dropped,
            },
            request = requests.recv() => match request {
                Some(channel) => {
                    if let Some(ended) = reconcile(wakes, &mut sink, &mut subscribed, channel).await {
                        return ended;
                    }
                }
                None => return Ended::Stop,
            },
            () = tokio::time::sleep(IDLE), if idle => {
                if wakes.watched().is_empty() {
                    return Ended::Stop;
                }
            }
        }
    }
}

/// Subscribes `channel` when it is watched and not subscribed, unsubscribes it when it is
/// subscribed and no longer watched. `Some` when the session must end.
async fn reconcile(
    wakes: &Wakes,
    sink: &mut PubSubSink,
    subscribed: &mut HashSet<Arc<[u8]>>,
    channel: Arc<[u8]>,
) -> Option<Ended> {
    let wanted = wakes.wanted(&channel);
    let have = subscribed.contains(&channel);
    // Subscribed again to go to the back of the delivery order (see [`Wakes::to_back`]).
    let to_back = wakes.take_to_back(&channel) && wanted && have;
    if wanted == have && !to_back {
        if wanted {
            // Asked again for a channel that is up (a watcher that saw it down, racing the
            // resubscription): mark it live again.
            wakes.up(&channel);
        }
        return None;
    }
    let outcome = if to_back {
        // Both commands go out together (the second queued before the first is answered), so
        // the server runs them back to back: no release falls between them.
        let mut again_sink = sink.clone();
        tokio::time::timeout(wakes.timeout, async {
            let (out, again) = tokio::join!(
                sink.unsubscribe(&channel[..]),
                again_sink.subscribe(&channel[..])
            );
            out.and(again)
        })
        .await
    } else if wanted {
        let first = subscribed.is_empty();
        tokio::time::timeout(wakes.timeout, async {
            sink.subscribe(&channel[..]).await?;
            if first {
                confirm_subscribed(sink).await?;
            }
            Ok(())
        })
        .await
    } else {
        tokio::time::timeout(wakes.timeout, sink.unsubscribe(&channel[..])).await
    };
    match outcome {
        Ok(Ok(())) => {
            if wanted {
                subscribed.insert(Arc::clone(&channel));
                wakes.up(&channel);
            } else {
                subscribed.remove(&channel);
            }
            None
        }
        Ok(Err(err)) if err.kind() == ErrorKind::Server(ServerErrorKind::NoPerm) => {
            if !wakes.refused.swap(true, Ordering::SeqCst) {
                tracing::warn!(
                    error = %err,
                    "redis waiters poll instead of being woken by releases: the server refused \
                     SUBSCRIBE (grant the Redis user `+subscribe +unsubscribe` and the channels \
                     `&<prefix>{{*`, see Permissions in the dlock::redis docs)"
                );
            }
            Some(Ended::Stop)
        }
        Ok(Err(err)) => {
            tracing::debug!(error = %err, "the redis subscriber failed; reconnecting");
            Some(Ended::Dropped)
        }
        Err(_) => Some(Ended::Dropped),
    }
}

/// Checks that the connection is subscribed after its first `SUBSCRIBE`: the driver's sink
/// answers `Ok` even when the server refused it (a `NOPERM` for the command or the channel),
/// so a `PING` follows, which a subscribed connection answers `["pong", message]` and any
/// other answers as a plain reply. Anything but the subscribed answer is taken as a refusal
/// (also on `protocol=resp3`, whose answer is plain: its waiters poll).
async fn confirm_subscribed(sink: &mut PubSubSink) -> redis::RedisResult<()> {
    match sink.ping_message::<redis::Value>("dlock").await? {
        redis::Value::Array(items) if matches!(items.first(), Some(redis::Value::BulkString(kind)) if kind == b"pong") => {
            Ok(())
        }
        _ => Err(redis::RedisError::from((
            ErrorKind::Server(ServerErrorKind::NoPerm),
            "NOPERM",
            "the server did not subscribe the connection (SUBSCRIBE refused)".to_owned(),
        ))),
    }
}

/// One waiter's watch on a channel.
struct RedisWatch {
    wakes: Arc<Wakes>,
    channel: Arc<[u8]>,
    receiver: watch::Receiver<Signal>,
}

impl std::fmt::Debug for RedisWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisWatch")
            .field("channel", &String::from_utf8_lossy(&self.channel))
            .field("live", &self.receiver.borrow().live)
            .finish()
    }
}

impl Drop for RedisWatch {
    fn drop(&mut self) {
        self.wakes.unwatch(&self.channel);
    }
}

impl ReleaseWatch for RedisWatch {
    fn is_live(&self) -> bool {
        self.receiver.borrow().live
    }

    fn mark_seen(&mut self) {
        self.receiver.borrow_and_update();
    }

    fn woken(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if !self.receiver.borrow().live && self.wakes.available() {
                // No driver may be running (its runtime shut down): start one here.
                self.wakes.keep_driven(&self.channel);
            }
            if self.receiver.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::redis::commands::live_tests::{Flavor, Server};

    /// A hold-off long enough to tell apart from a wake-up's round trip.
    const CONCLUSIVE: Duration = Duration::from_millis(40);

    /// Holds `key` off (50 ms, the longest), publishes `message` on its channel, and answers
    /// whether the hold-off was still on once the watch saw the message; `None` when the
    /// message took too long for the answer to mean anything (the hold-off may have run out).
    async fn hold_off_outlives(
        watch: &mut Box<dyn ReleaseWatch>,
        hold_offs: &HoldOffs,
        admin: &mut redis::aio::MultiplexedConnection,
        key: &Arc<[u8]>,
        message: &[u8],
    ) -> Option<bool> {
        watch.mark_seen();
        hold_offs.released(key, 1, Duration::from_secs(1));
        let set = Instant::now();
        let _: i64 = redis::cmd("PUBLISH")
            .arg(&key[..])
            .arg(message)
            .query_async(admin)
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(10), watch.woken())
            .await
            .expect("the message woke the watch");
        let on = hold_offs.left(key).is_some();
        (set.elapsed() < CONCLUSIVE).then_some(on)
    }

    /// A subscriber that hears a release of another backend (a message that is not its own
    /// backend's announcer, an empty one included) ends that backend's hold-off on the key
    /// before it wakes the key's watchers; a release of its own backend leaves it on.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn another_backends_release_ends_the_hold_off() {
        let Some(server) = Server::start(Flavor::Redis7) else {
            return;
        };
        let conn = server.conn("").await;
        let own = conn.announcer();
        let hold_offs = Arc::new(HoldOffs::default());
        let heard = Heard {
            own: Arc::clone(&own),
            hold_offs: Arc::clone(&hold_offs),
        };
        let wakes = Arc::new(Wakes::new(
            Some(conn.client_slot()),
            Duration::from_secs(5),
            Some(heard),
        ));
        let key: Arc<[u8]> = Arc::from(&b"t:{held-off}"[..]);
        let mut watch = wakes.watch(&key).await.expect("wake-ups");
        assert!(watch.is_live());
        let mut admin = server.admin().await;
        for (message, stays_on) in [(&own[..], true), (b"0123456789abcdef", false), (b"", false)] {
            let mut answer = None;
            for _ in 0..50 {
                answer = hold_off_outlives(&mut watch, &hold_offs, &mut admin, &key, message).await;
                if answer.is_some() {
                    break;
                }
            }
            assert_eq!(
                answer,
                Some(stays_on),
                "message {:?}",
                String::from_utf8_lossy(message)
            );
        }
    }
}
