//! Limit profiles by channel (E-2, S0 AC-14/AC-15, S2): iterations and wall time, plus the
//! repetition guard (E-3). A limit ends the run gracefully with what it has.

use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    Web,
    Telegram,
    SessionOpen,
    Scheduled,
    Heartbeat,
    /// Background task agents (B-5).
    TaskAgent,
}

impl Channel {
    pub fn is_interactive(self) -> bool {
        matches!(
            self,
            Channel::Web | Channel::Telegram | Channel::SessionOpen
        )
    }

    pub fn key(self) -> &'static str {
        match self {
            Channel::Web => "web",
            Channel::Telegram => "telegram",
            Channel::SessionOpen => "session_open",
            Channel::Scheduled => "scheduled",
            Channel::Heartbeat => "heartbeat",
            Channel::TaskAgent => "task_agent",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    pub max_iterations: u32,
    pub max_wall: Duration,
    /// The same tool this many times in a row ends the loop (S2 MAX_SAME_TOOL_CONSECUTIVE).
    pub max_same_tool_consecutive: u32,
    /// Hard ceiling on input + output tokens for the run; `None` for none.
    pub max_total_tokens: Option<u64>,
    /// Hard ceiling on cost in US dollars; `None` for none.
    pub max_cost_usd: Option<f64>,
}

/// The profile for `channel`. `interactive_steps` (AGENT_MAX_LOOP_STEPS, clamped to 1..15)
/// overrides the interactive iteration limit.
pub fn profile(channel: Channel, interactive_steps: Option<u32>) -> Limits {
    let (max_iterations, secs) = match channel {
        Channel::SessionOpen => (3, 15),
        Channel::Web | Channel::Telegram => (interactive_steps.map_or(10, |s| s.clamp(1, 15)), 60),
        Channel::Scheduled | Channel::Heartbeat => (15, 600),
        Channel::TaskAgent => (20, 600),
    };
    Limits {
        max_iterations,
        max_wall: Duration::from_secs(secs),
        max_same_tool_consecutive: 5,
        max_total_tokens: None,
        max_cost_usd: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_follow_the_spec_and_the_override_is_clamped() {
        assert_eq!(profile(Channel::SessionOpen, Some(12)).max_iterations, 3);
        assert_eq!(
            profile(Channel::SessionOpen, None).max_wall,
            Duration::from_secs(15)
        );
        assert_eq!(profile(Channel::Web, None).max_iterations, 10);
        assert_eq!(profile(Channel::Web, Some(8)).max_iterations, 8);
        assert_eq!(profile(Channel::Telegram, Some(99)).max_iterations, 15);
        assert_eq!(profile(Channel::Web, Some(0)).max_iterations, 1);
        assert_eq!(
            profile(Channel::Heartbeat, None).max_wall,
            Duration::from_secs(600)
        );
        assert_eq!(profile(Channel::TaskAgent, None).max_iterations, 20);
    }
}
