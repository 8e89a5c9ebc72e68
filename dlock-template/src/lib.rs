//! The grammar of dlock's lock key templates, such as `"account:{account_id}"`, and the
//! encoding that keeps the keys they render injective.
//!
//! dlock's runtime templates (`dlock::key_template::KeyTemplate`, which the axum layer
//! renders from path parameters) and the `#[distributed_lock]` attribute (which renders from
//! arguments and fields) both parse with [`Template::parse`] and encode values with
//! [`encode_component`], so a template means the same in both, and one set of tests and one
//! fuzz target hold the promise that distinct values make distinct keys. Both also read
//! durations (`?lease=30s`, `timeout = "10s"`) with [`parse_duration`].
//!
//! # Grammar
//!
//! | in the template | means |
//! |---|---|
//! | `{path}` or `<path>` | a [`Placeholder`]: the value `path` names, [encoded](encode_component) |
//! | `{{` `}}` `<<` `>>` | a literal `{` `}` `<` `>` |
//! | anything else | itself, as literal text |
//!
//! - **A path** is one or more segments joined by `.` (`{cmd.owner.0}`); whitespace around
//!   the path and around each `.` is ignored.
//! - **A segment** is a Rust identifier or a tuple index, because in the attribute a path
//!   names an argument or field and reaches into it as Rust's `cmd.owner.0` does:
//!   - an identifier starts with `_` or a letter and goes on with `_`, letters and digits,
//!     Unicode ones included (`{ключ}`; letters and digits as [`char::is_alphabetic`] and
//!     [`char::is_alphanumeric`] define them: without dependencies, the standard library's
//!     approximation of Unicode's XID classes, which is off for rare characters such as `²`,
//!     taken here though Rust refuses it, and combining marks, refused here. In the attribute
//!     such a name matches no argument or field and is reported as unknown). `_` alone is not
//!     an identifier.
//!   - a raw identifier `r#name` is the identifier `name` ([`Placeholder::name`] is
//!     `type` for `{r#type}`, as the parameter `r#type` is named `type`). As in Rust,
//!     `r#_`, `r#self`, `r#super`, `r#crate` and `r#Self` are not identifiers.
//!   - a tuple index is `0` or a decimal number without leading zeros that fits in a `u32`.
//!     It may also start a path: tuple structs name their fields `0`, `1`, ...
//! - **The separator rule.** The literal text between two placeholders must contain a
//!   [separator](is_separator): `:`, `{`, `}`, `<`, `>` or a control character (`:` by
//!   convention). `"{a}-{b}"` is refused because `("x-y", "z")` and `("x", "y-z")` would render
//!   to the same key `x-y-z`.
//! - **Mistakes are errors**, never literal text: an unclosed `{` or `<`, a `}` or `>` that
//!   closes nothing, an empty or malformed path ([`ParseError`]). So a typo never silently
//!   becomes part of every key.
//!
//! # Why rendered keys are injective
//!
//! [`encode_component`] percent-encodes `%` and every separator, so an encoded value never
//! contains a separator. Read a key rendered from a template left to right: the literal text
//! before the first placeholder is fixed. If another placeholder follows, the first separator
//! after that text belongs to the literal between the two (the value has none), which fixes
//! where the first value ends; otherwise the fixed literal at the end does. And so on, value
//! by value. The encoding is itself injective (`%` is encoded too, so `%3A` in a value stays
//! distinct from `:`), so distinct values, placeholder by placeholder, give distinct keys.
//!
//! ```
//! use dlock_template::{Segment, Template};
//!
//! let template = Template::parse("transfer:{from}:<to.id>:{{x}}").unwrap();
//! let names: Vec<&str> = template.placeholders().map(|p| p.name()).collect();
//! assert_eq!(names, ["from", "to.id"]);
//! assert!(matches!(&template.segments()[4], Segment::Literal(text) if text == ":{x}"));
//!
//! let key = template.render(|p| match p.name() {
//!     "from" => Some("1:2"),
//!     "to.id" => Some("3"),
//!     _ => None,
//! });
//! assert_eq!(key.unwrap(), "transfer:1%3A2:3:{x}");
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

use std::borrow::Cow;
use std::fmt::{self, Display, Write as _};
use std::str::FromStr;

mod duration;

pub use duration::{DURATION_UNITS, DurationError, parse_duration};

/// Whether `c` keeps two placeholders apart: `:` `{` `}` `<` `>` and control characters
/// ([`char::is_control`]). Encoded values never contain one, so a separator in the literal
/// text between two placeholders shows where the first value ends.
///
/// ```
/// use dlock_template::is_separator;
///
/// assert!(is_separator(':') && is_separator('>') && is_separator('\n'));
/// assert!(!is_separator('-') && !is_separator('/') && !is_separator('%'));
/// ```
pub fn is_separator(c: char) -> bool {
    matches!(c, ':' | '{' | '}' | '<' | '>') || c.is_control()
}

/// Whether [`encode_component`] encodes `c`: every [separator](is_separator), and `%`.
///
/// ```
/// use dlock_template::needs_encoding;
///
/// assert!(needs_encoding('%') && needs_encoding(':') && needs_encoding('\u{85}'));
/// assert!(!needs_encoding('/') && !needs_encoding('é'));
/// ```
pub fn needs_encoding(c: char) -> bool {
    c == '%' || is_separator(c)
}

/// Percent-encodes the characters of a template value that could make two distinct values
/// render to the same key: `:` `%` `{` `}` `<` `>` and control characters (`char::is_control`:
/// U+0000–U+001F, U+007F–U+009F), each as `%XX` (uppercase hex) of its UTF-8 bytes.
///
/// Everything else, including non-ASCII letters, is kept as is. Returns the value borrowed
/// when nothing needs encoding, so the common case does not allocate.
///
/// ```
/// use dlock_template::encode_component;
///
/// assert_eq!(encode_component("42"), "42");
/// assert_eq!(encode_component("a:b%c"), "a%3Ab%25c");
/// assert_eq!(encode_component("{x}<y>"), "%7Bx%7D%3Cy%3E");
/// assert_eq!(encode_component("line\nbreak\u{85}"), "line%0Abreak%C2%85");
/// assert_eq!(encode_component("ключ/ü"), "ключ/ü");
/// ```
pub fn encode_component(value: &str) -> Cow<'_, str> {
    if !value.contains(needs_encoding) {
        return Cow::Borrowed(value);
    }
    let mut out = String::with_capacity(value.len() + 8);
    push_encoded(&mut out, value);
    Cow::Owned(out)
}

/// Appends `value` to `out`, encoded as [`encode_component`] describes.
fn push_encoded(out: &mut String, value: &str) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut rest = value;
    while let Some(at) = rest.find(needs_encoding) {
        out.push_str(&rest[..at]);
        let Some(c) = rest[at..].chars().next() else {
            break;
        };
        let mut utf8 = [0u8; 4];
        for byte in c.encode_utf8(&mut utf8).bytes() {
            out.push('%');
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0x0F)]));
        }
        rest = &rest[at + c.len_utf8()..];
    }
    out.push_str(rest);
}

/// Streams a value's [`Display`] output into a key, encoded, without an intermediate string.
struct Encoder<'a>(&'a mut String);

impl fmt::Write for Encoder<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        push_encoded(self.0, s);
        Ok(())
    }
}

/// Builds a lock key from literal text and encoded values, the way
/// `#[distributed_lock("...")]` does.
///
/// [`literal`](KeyBuilder::literal) appends text as it is; [`value`](KeyBuilder::value)
/// appends a value's [`Display`] output encoded by [`encode_component`].
///
/// ```
/// use dlock_template::KeyBuilder;
///
/// let mut key = KeyBuilder::new();
/// key.literal("transfer:").value(&"1:2").literal(":").value(&3);
/// assert_eq!(key.finish(), "transfer:1%3A2:3");
/// ```
#[derive(Debug, Default, Clone)]
pub struct KeyBuilder {
    key: String,
}

impl KeyBuilder {
    /// An empty key.
    pub fn new() -> Self {
        KeyBuilder::default()
    }

    /// An empty key with room for `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Self {
        KeyBuilder {
            key: String::with_capacity(capacity),
        }
    }

    /// Appends `text` as it is.
    pub fn literal(&mut self, text: &str) -> &mut Self {
        self.key.push_str(text);
        self
    }

    /// Appends `value`'s [`Display`] output, percent-encoded (see [`encode_component`]).
    pub fn value(&mut self, value: &(impl Display + ?Sized)) -> &mut Self {
        // Writing to a `String` cannot fail; a `Display` impl that reports an error anyway
        // keeps what it wrote before the error.
        let _ = write!(Encoder(&mut self.key), "{value}");
        self
    }

    /// The key.
    pub fn finish(self) -> String {
        self.key
    }
}

/// A parsed key template: literal text and placeholders, in order.
///
/// See the [crate documentation](crate) for the grammar. Parse once, render per call.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Template {
    segments: Vec<Segment>,
}

/// A piece of a [`Template`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Segment {
    /// Text copied into the key as it is, escapes resolved (`{{` is `{`). Never empty, and
    /// never next to another literal.
    Literal(String),
    /// A value to encode into the key.
    Placeholder(Placeholder),
}

/// A placeholder, `{path}` or `<path>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Placeholder {
    position: usize,
    written: String,
    name: String,
}

impl Placeholder {
    /// The path, its segments joined by `.`, without whitespace and without `r#`:
    /// `cmd.owner.0` for `{ cmd . owner.0 }`, `type` for `{r#type}`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The path's segments ([`name`](Placeholder::name) split at `.`).
    pub fn path(&self) -> impl Iterator<Item = &str> + '_ {
        self.name.split('.')
    }

    /// The first segment: the argument, field or value the path starts from.
    pub fn root(&self) -> &str {
        self.path().next().unwrap_or_default()
    }

    /// The segments after the root: field names and tuple indices reached into.
    pub fn members(&self) -> impl Iterator<Item = &str> + '_ {
        self.path().skip(1)
    }

    /// The placeholder as written, delimiters included (`<to.id>`), for messages.
    pub fn written(&self) -> &str {
        &self.written
    }

    /// Byte offset of its opening `{` or `<` in the template.
    pub fn position(&self) -> usize {
        self.position
    }
}

/// Why a template does not parse.
///
/// Positions are byte offsets into the template text. The [`Display`] form is a sentence
/// that says what to write instead; it does not repeat the position.
///
/// Exhaustive on purpose: the crates that map these errors to their own (the library's
/// `TemplateError`, the attribute's compile errors) must handle a new kind of mistake, so a
/// new variant is a breaking change of this crate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParseError {
    /// The `{` or `<` at `position` has no matching `}` or `>`.
    Unclosed {
        /// Byte offset of the opening character.
        position: usize,
        /// The opening character, `{` or `<`.
        open: char,
    },
    /// The `}` or `>` at `position` closes nothing (`}}` or `>>` is the literal character).
    Unopened {
        /// Byte offset of the character.
        position: usize,
        /// The character, `}` or `>`.
        close: char,
    },
    /// The placeholder at `position` names nothing (`{}`, `< >`).
    EmptyName {
        /// Byte offset of the opening character.
        position: usize,
        /// The placeholder as written, delimiters included.
        written: String,
    },
    /// The placeholder at `position` is not a path of identifiers and tuple indices.
    BadName {
        /// Byte offset of the opening character.
        position: usize,
        /// The placeholder as written, delimiters included.
        written: String,
        /// What is between the delimiters, without surrounding whitespace.
        name: String,
    },
    /// The placeholder at `position` follows another with no [separator](is_separator) in
    /// the text between them, so distinct values could render to the same key.
    NoSeparator {
        /// Byte offset of the second placeholder's opening character.
        position: usize,
        /// The first placeholder as written.
        previous: String,
        /// The second placeholder as written.
        written: String,
        /// The literal text between them, escapes resolved (empty when they touch).
        between: String,
    },
}

impl ParseError {
    /// Byte offset in the template of the character the error is about.
    pub fn position(&self) -> usize {
        match self {
            ParseError::Unclosed { position, .. }
            | ParseError::Unopened { position, .. }
            | ParseError::EmptyName { position, .. }
            | ParseError::BadName { position, .. }
            | ParseError::NoSeparator { position, .. } => *position,
        }
    }
}

impl Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseError::Unclosed { open, .. } => {
                let close = if *open == '<' { '>' } else { '}' };
                write!(
                    f,
                    "unclosed `{open}` in the key template: close the placeholder with \
                     `{close}`, or write `{open}{open}` for a literal `{open}`"
                )
            }
            ParseError::Unopened { close, .. } => write!(
                f,
                "unmatched `{close}` in the key template; write `{close}{close}` for a literal \
                 `{close}`"
            ),
            ParseError::EmptyName { written, .. } => write!(
                f,
                "empty placeholder `{written}`: name a parameter or field, such as \
                 `{{account_id}}`; double the braces for literal text (`{{{{}}}}`)"
            ),
            ParseError::BadName { written, .. } => write!(
                f,
                "invalid placeholder `{}`: a placeholder names a parameter or field, \
                 optionally followed by `.field`s, such as `{{account_id}}` or \
                 `{{cmd.account_id}}`",
                written.escape_debug()
            ),
            ParseError::NoSeparator {
                previous,
                written,
                between,
                ..
            } if between.is_empty() => write!(
                f,
                "placeholders `{previous}` and `{written}` need a `:` between them: without \
                 one, distinct values could give the same key (\"ab\" + \"c\" and \"a\" + \"bc\")"
            ),
            ParseError::NoSeparator {
                previous,
                written,
                between,
                ..
            } => write!(
                f,
                "placeholders `{previous}` and `{written}` need a `:` between them: with only \
                 `{}`, distinct values could give the same key",
                between.escape_debug()
            ),
        }
    }
}

impl std::error::Error for ParseError {}

impl Template {
    /// Parses `text`. An empty text is a template with no segments.
    ///
    /// ```
    /// use dlock_template::{ParseError, Template};
    ///
    /// let t = Template::parse("{{literal}}:<id>:{tenant.id}").unwrap();
    /// assert_eq!(t.placeholders().map(|p| p.name()).collect::<Vec<_>>(), ["id", "tenant.id"]);
    /// assert_eq!(
    ///     Template::parse("account:{id"),
    ///     Err(ParseError::Unclosed { position: 8, open: '{' })
    /// );
    /// ```
    pub fn parse(text: &str) -> Result<Template, ParseError> {
        let mut segments = Vec::new();
        let mut literal = String::new();
        let mut chars = text.char_indices().peekable();
        while let Some((position, c)) = chars.next() {
            match c {
                '{' | '<' | '}' | '>' if chars.peek().is_some_and(|&(_, next)| next == c) => {
                    chars.next();
                    literal.push(c);
                }
                '{' | '<' => {
                    let close = if c == '{' { '}' } else { '>' };
                    let start = position + 1;
                    let Some(len) = text[start..].find(close) else {
                        return Err(ParseError::Unclosed { position, open: c });
                    };
                    let end = start + len + 1;
                    // Skip the path and the closing character.
                    while chars.next_if(|&(i, _)| i < end).is_some() {}
                    let placeholder = Placeholder::parse(position, &text[position..end])?;
                    if !literal.is_empty() {
                        segments.push(Segment::Literal(std::mem::take(&mut literal)));
                    }
                    let between = match segments.as_slice() {
                        [.., Segment::Placeholder(previous)] => Some((previous, "")),
                        [
                            ..,
                            Segment::Placeholder(previous),
                            Segment::Literal(between),
                        ] if !between.contains(is_separator) => Some((previous, between.as_str())),
                        _ => None,
                    };
                    if let Some((previous, between)) = between {
                        return Err(ParseError::NoSeparator {
                            position,
                            previous: previous.written.clone(),
                            written: placeholder.written,
                            between: between.to_owned(),
                        });
                    }
                    segments.push(Segment::Placeholder(placeholder));
                }
                '}' | '>' => return Err(ParseError::Unopened { position, close: c }),
                _ => literal.push(c),
            }
        }
        if !literal.is_empty() {
            segments.push(Segment::Literal(literal));
        }
        Ok(Template { segments })
    }

    /// The literals and placeholders, in order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// The placeholders, in order of appearance (a repeated path appears repeatedly).
    pub fn placeholders(&self) -> impl Iterator<Item = &Placeholder> + '_ {
        self.segments.iter().filter_map(|segment| match segment {
            Segment::Placeholder(placeholder) => Some(placeholder),
            Segment::Literal(_) => None,
        })
    }

    /// A guess at a rendered key's length, to size its buffer: the literal text plus 8 bytes
    /// per placeholder.
    pub fn capacity_hint(&self) -> usize {
        self.segments
            .iter()
            .map(|segment| match segment {
                Segment::Literal(text) => text.len(),
                Segment::Placeholder(_) => 8,
            })
            .sum()
    }

    /// Renders the key: literals as they are, each placeholder as `value(placeholder)`
    /// passed through [`encode_component`]. Fails with the first placeholder for which
    /// `value` returns `None`.
    ///
    /// ```
    /// use dlock_template::Template;
    ///
    /// let t = Template::parse("transfer:{from}->>{to}").unwrap();
    /// let key = t.render(|p| match p.name() {
    ///     "from" => Some("a"),
    ///     "to" => Some("b:c"),
    ///     _ => None,
    /// });
    /// assert_eq!(key.unwrap(), "transfer:a->b%3Ac");
    /// assert_eq!(t.render(|_| None::<&str>).unwrap_err().name(), "from");
    /// ```
    pub fn render<F, V>(&self, mut value: F) -> Result<String, &Placeholder>
    where
        F: FnMut(&Placeholder) -> Option<V>,
        V: AsRef<str>,
    {
        let mut key = String::with_capacity(self.capacity_hint());
        for segment in &self.segments {
            match segment {
                Segment::Literal(text) => key.push_str(text),
                Segment::Placeholder(placeholder) => match value(placeholder) {
                    Some(v) => push_encoded(&mut key, v.as_ref()),
                    None => return Err(placeholder),
                },
            }
        }
        Ok(key)
    }
}

impl FromStr for Template {
    type Err = ParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Template::parse(s)
    }
}

impl Placeholder {
    /// Parses `written`, a whole placeholder with its delimiters, found at `position`.
    fn parse(position: usize, written: &str) -> Result<Placeholder, ParseError> {
        // The delimiters are ASCII, one byte each.
        let inner = written[1..written.len() - 1].trim();
        if inner.is_empty() {
            return Err(ParseError::EmptyName {
                position,
                written: written.to_owned(),
            });
        }
        let mut name = String::with_capacity(inner.len());
        for (i, segment) in inner.split('.').map(str::trim).enumerate() {
            let Some(segment) = path_segment(segment) else {
                return Err(ParseError::BadName {
                    position,
                    written: written.to_owned(),
                    name: inner.to_owned(),
                });
            };
            if i > 0 {
                name.push('.');
            }
            name.push_str(segment);
        }
        Ok(Placeholder {
            position,
            written: written.to_owned(),
            name,
        })
    }
}

/// A path segment without its `r#`, or `None` if it is neither an identifier nor a tuple
/// index.
fn path_segment(segment: &str) -> Option<&str> {
    let is_index = segment == "0"
        || (segment.starts_with(|c: char| c.is_ascii_digit() && c != '0')
            && segment.parse::<u32>().is_ok());
    if is_index {
        return Some(segment);
    }
    let (raw, ident) = match segment.strip_prefix("r#") {
        Some(ident) => (true, ident),
        None => (false, segment),
    };
    let mut chars = ident.chars();
    let is_identifier = chars
        .next()
        .is_some_and(|first| first == '_' || first.is_alphabetic())
        && chars.all(|c| c == '_' || c.is_alphanumeric())
        && ident != "_";
    let raw_allowed = !(raw && matches!(ident, "self" | "super" | "crate" | "Self"));
    (is_identifier && raw_allowed).then_some(ident)
}

#[cfg(test)]
mod tests;
