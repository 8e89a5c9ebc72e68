//! Code generation for functions and structs.

use proc_macro2::{Span, TokenStream};
use quote::{ToTokens, quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{Fields, FnArg, Ident, Index, Item, ItemFn, ItemStruct, Member, Pat, ReturnType, Type};

use dlock_template::{Placeholder, Segment};

use crate::attr::{Args, Keys, Mode, OnLost, Template, Timeout};

/// Entry point: the expansion, or the original item plus `compile_error!`s.
pub(crate) fn distributed_lock(args: TokenStream, item: TokenStream) -> TokenStream {
    let expanded = syn::parse2::<Item>(item.clone())
        .map_err(|_| {
            syn::Error::new(
                Span::call_site(),
                "#[distributed_lock] applies to `async fn`s and to structs",
            )
        })
        .and_then(|parsed| {
            let args = syn::parse2::<Args>(args);
            match parsed {
                Item::Fn(function) => expand_fn(args?, function),
                Item::Struct(command) => expand_struct(args?, command),
                other => Err(syn::Error::new(
                    item_keyword_span(&other),
                    "#[distributed_lock] applies to `async fn`s and to structs",
                )),
            }
        });
    match expanded {
        Ok(tokens) => tokens,
        Err(err) => {
            // Keep the item as it was, so the rest of the crate (and the IDE) still sees it.
            let errors = err.to_compile_error();
            quote!(#item #errors)
        }
    }
}

fn item_keyword_span(item: &Item) -> Span {
    match item {
        Item::Enum(e) => e.enum_token.span,
        Item::Union(u) => u.union_token.span,
        Item::Impl(i) => i.impl_token.span,
        Item::Trait(t) => t.trait_token.span,
        other => other.span(),
    }
}

/// Collects errors so that one expansion reports every mistake it finds.
#[derive(Default)]
struct Errors(Option<syn::Error>);

impl Errors {
    fn push(&mut self, err: syn::Error) {
        match &mut self.0 {
            Some(errors) => errors.combine(err),
            None => self.0 = Some(err),
        }
    }

    fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

/// A name a placeholder can start from, and the tokens that reach it.
struct Binding {
    name: String,
    tokens: TokenStream,
}

fn unraw(ident: &Ident) -> String {
    let name = ident.to_string();
    name.strip_prefix("r#").map_or(name.clone(), str::to_owned)
}

/// The statements that build the key into a `String` expression.
fn key_expr(
    template: &Template,
    bindings: &[Binding],
    what: &str,
    errors: &mut Errors,
) -> TokenStream {
    let span = template.lit.span();
    let capacity = template.parsed.capacity_hint();
    // Invisible to the placeholders' expressions, which may name anything.
    let builder = Ident::new("__dlock_key_builder", Span::mixed_site().located_at(span));
    let mut steps = Vec::new();
    for segment in template.parsed.segments() {
        match segment {
            Segment::Literal(text) => steps.push(quote_spanned!(span=> #builder.literal(#text);)),
            Segment::Placeholder(placeholder) => match resolve(placeholder, bindings, what, span) {
                Ok(value) => steps.push(quote_spanned!(span=> #builder.value(&#value);)),
                Err(message) => errors.push(syn::Error::new(span, message)),
            },
        }
    }
    quote_spanned! {span=>
        {
            let mut #builder = ::dlock::__private::KeyBuilder::with_capacity(#capacity);
            #(#steps)*
            #builder.finish()
        }
    }
}

/// The expression a placeholder names, or why it names none.
fn resolve(
    placeholder: &Placeholder,
    bindings: &[Binding],
    what: &str,
    span: Span,
) -> Result<TokenStream, String> {
    let root = placeholder.root();
    let Some(binding) = bindings.iter().find(|b| b.name == root) else {
        let names = bindings
            .iter()
            .map(|b| format!("`{}`", b.name))
            .collect::<Vec<_>>();
        let known = if names.is_empty() {
            format!("there are no {what}s")
        } else {
            format!("the {what}s are {}", names.join(", "))
        };
        return Err(format!(
            "unknown placeholder `{}`: no {what} is named `{root}`; {known}",
            placeholder.written()
        ));
    };
    let tokens = &binding.tokens;
    let members = placeholder
        .members()
        .map(|name| {
            member(name, span).ok_or_else(|| {
                format!(
                    "invalid placeholder `{}`: `{name}` is not a Rust field name",
                    placeholder.written()
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(quote_spanned!(span=> (#tokens #(.#members)*)))
}

/// A field name (a keyword as a raw identifier) or tuple index, or `None` if `name` is
/// neither: the grammar's letters and digits only approximate Rust's.
fn member(name: &str, span: Span) -> Option<Member> {
    if let Ok(index) = name.parse::<u32>() {
        return Some(Member::Unnamed(Index { index, span }));
    }
    let mut ident = syn::parse_str::<Ident>(name)
        .or_else(|_| syn::parse_str::<Ident>(&format!("r#{name}")))
        .ok()?;
    ident.set_span(span);
    Some(Member::Named(ident))
}

fn expand_struct(args: Args, command: ItemStruct) -> syn::Result<TokenStream> {
    let mut errors = Errors::default();
    if let Some((keyword, _)) = &args.provider {
        errors.push(syn::Error::new(
            keyword.span,
            "`provider` is an option of functions; for a struct, take the lock with \
             `locks.acquire_for(&command)` (the only option here is `timeout`)",
        ));
    }
    if let Some((keyword, _)) = &args.guard {
        errors.push(syn::Error::new(
            keyword.span,
            "`guard` is an option of functions; for a struct, `locks.acquire_for(&command)` \
             returns the guard (the only option here is `timeout`)",
        ));
    }
    if let Some((keyword, _)) = &args.on_lost {
        errors.push(syn::Error::new(
            keyword.span,
            "`on_lost` is an option of functions; for a struct, watch the `lost_token()` of the \
             guard `locks.acquire_for(&command)` returns (the only option here is `timeout`)",
        ));
    }
    if let Keys::Many(keyword, _) = &args.keys {
        errors.push(syn::Error::new(
            keyword.span,
            "`keys(...)` is an option of functions: a command names one lock \
             (`LockedCommand::lock_key`). To take several keys for a command, call \
             `locks.acquire_many(&[..], timeout)`, or put the attribute on the function that \
             runs the command",
        ));
    }
    if let Some((keyword, _)) = &args.mode {
        errors.push(syn::Error::new(
            keyword.span,
            "`mode` is an option of functions: `locks.acquire_for(&command)` takes an \
             exclusive lock. For a read lock, call `locks.acquire_read(&command.lock_key(), \
             command.lock_timeout())`, or put the attribute on the function that runs the \
             command",
        ));
    }
    if let Some((keyword, _)) = &args.permits {
        errors.push(syn::Error::new(
            keyword.span,
            "`permits` is an option of functions: `locks.acquire_for(&command)` takes an \
             exclusive lock. For a semaphore, call `locks.acquire_semaphore(&command.lock_key(), \
             n, command.lock_timeout())`, or put the attribute on the function that runs the \
             command",
        ));
    }
    let Some(template) = args.keys.templates().first() else {
        return Err(syn::Error::new(
            Span::call_site(),
            "#[distributed_lock] needs a key template",
        ));
    };
    let span = template.lit.span();
    let bindings: Vec<Binding> = match &command.fields {
        Fields::Named(fields) => fields
            .named
            .iter()
            .filter_map(|field| field.ident.as_ref())
            .map(|ident| {
                let mut ident = ident.clone();
                ident.set_span(span);
                Binding {
                    name: unraw(&ident),
                    tokens: quote_spanned!(span=> self.#ident),
                }
            })
            .collect(),
        Fields::Unnamed(fields) => (0..fields.unnamed.len())
            .map(|i| {
                let index = Index {
                    index: u32::try_from(i).unwrap_or(u32::MAX),
                    span,
                };
                Binding {
                    name: i.to_string(),
                    tokens: quote_spanned!(span=> self.#index),
                }
            })
            .collect(),
        Fields::Unit => Vec::new(),
    };
    let key = key_expr(template, &bindings, "field", &mut errors);
    errors.finish()?;

    let timeout = Timeout::tokens(args.timeout.as_ref());
    let name = &command.ident;
    let (impl_generics, type_generics, where_clause) = command.generics.split_for_impl();
    Ok(quote! {
        #command

        impl #impl_generics ::dlock::LockedCommand for #name #type_generics #where_clause {
            fn lock_key(&self) -> ::std::string::String #key

            fn lock_timeout(&self) -> ::core::time::Duration {
                #timeout
            }
        }
    })
}

/// Whether `ty` names `LockProvider` (any path, behind any number of references).
fn is_provider_type(ty: &Type) -> bool {
    match ty {
        Type::Reference(reference) => is_provider_type(&reference.elem),
        Type::Paren(paren) => is_provider_type(&paren.elem),
        Type::Group(group) => is_provider_type(&group.elem),
        Type::Path(path) => {
            path.qself.is_none()
                && path
                    .path
                    .segments
                    .last()
                    .is_some_and(|last| last.ident == "LockProvider" && last.arguments.is_none())
        }
        _ => false,
    }
}

/// Whether `ty` looks like a `Result`: a path whose last segment is `Result` or ends in it
/// (`io::Result<T>`, `anyhow::Result<T>`, `AppResult<T>`).
fn is_result_type(ty: &Type) -> bool {
    match ty {
        Type::Paren(paren) => is_result_type(&paren.elem),
        Type::Group(group) => is_result_type(&group.elem),
        Type::Path(path) => path
            .path
            .segments
            .last()
            .is_some_and(|last| last.ident.to_string().ends_with("Result")),
        _ => false,
    }
}

/// Every name a pattern binds, in order.
fn pattern_bindings(pat: &Pat, out: &mut Vec<Ident>) {
    match pat {
        Pat::Ident(ident) => {
            out.push(ident.ident.clone());
            if let Some((_, sub)) = &ident.subpat {
                pattern_bindings(sub, out);
            }
        }
        Pat::Paren(p) => pattern_bindings(&p.pat, out),
        Pat::Reference(p) => pattern_bindings(&p.pat, out),
        Pat::Type(p) => pattern_bindings(&p.pat, out),
        Pat::Tuple(p) => p.elems.iter().for_each(|p| pattern_bindings(p, out)),
        Pat::TupleStruct(p) => p.elems.iter().for_each(|p| pattern_bindings(p, out)),
        Pat::Slice(p) => p.elems.iter().for_each(|p| pattern_bindings(p, out)),
        Pat::Struct(p) => p
            .fields
            .iter()
            .for_each(|field| pattern_bindings(&field.pat, out)),
        _ => {}
    }
}

fn expand_fn(args: Args, mut function: ItemFn) -> syn::Result<TokenStream> {
    let mut errors = Errors::default();
    let sig = &function.sig;
    if sig.asyncness.is_none() {
        errors.push(syn::Error::new(
            sig.fn_token.span,
            "#[distributed_lock] needs an `async fn`: taking the lock waits for the lock store. \
             Make the function `async`, or put the attribute on a struct and take the lock with \
             `locks.acquire_for(&command)`",
        ));
    }
    let return_type = match &sig.output {
        ReturnType::Type(_, ty) if is_result_type(ty) => Some(ty.clone()),
        output => {
            let span = match output {
                ReturnType::Type(_, ty) => ty.span(),
                ReturnType::Default => sig.paren_token.span.join(),
            };
            errors.push(syn::Error::new(
                span,
                "#[distributed_lock] needs the function to return a `Result` whose error type \
                 implements `From<dlock::LockError>`, to report a lock that could not be taken",
            ));
            None
        }
    };

    // What placeholders can name, and which parameters are providers.
    let mut bindings = Vec::new();
    let mut providers = Vec::new();
    for input in &sig.inputs {
        match input {
            FnArg::Receiver(receiver) => {
                let self_token = &receiver.self_token;
                bindings.push(Binding {
                    name: "self".to_owned(),
                    tokens: self_token.to_token_stream(),
                });
            }
            FnArg::Typed(typed) => {
                let mut names = Vec::new();
                pattern_bindings(&typed.pat, &mut names);
                if is_provider_type(&typed.ty) {
                    providers.push((typed, names.first().cloned()));
                }
                bindings.extend(names.into_iter().map(|ident| Binding {
                    name: unraw(&ident),
                    tokens: ident.into_token_stream(),
                }));
            }
        }
    }
    let keys: Vec<TokenStream> = args
        .keys
        .templates()
        .iter()
        .map(|template| key_expr(template, &bindings, "parameter", &mut errors))
        .collect();

    let provider = match (&args.provider, providers.as_slice()) {
        (Some((_, expr)), _) => Some(expr.clone()),
        (None, [(_, Some(name))]) => Some(syn::parse_quote!(#name)),
        (None, [(typed, None)]) => {
            errors.push(syn::Error::new(
                typed.pat.span(),
                "#[distributed_lock] takes the lock through this `LockProvider` parameter: bind \
                 it to a name, such as `locks: &LockProvider`",
            ));
            None
        }
        (None, []) => {
            errors.push(syn::Error::new(
                sig.ident.span(),
                "#[distributed_lock] found no `LockProvider` parameter to take the lock with: add \
                 one (`locks: &LockProvider`), or name the provider with `provider = <expr>`, such \
                 as `provider = self.locks` or `provider = state.locks`",
            ));
            None
        }
        (None, [_, (second, _), ..]) => {
            errors.push(syn::Error::new(
                second.span(),
                "#[distributed_lock] found several `LockProvider` parameters: pick the one to \
                 lock with, such as `provider = locks`",
            ));
            None
        }
    };
    errors.finish()?;
    let (Some(return_type), Some(provider)) = (return_type, provider) else {
        // Every `None` above came with an error, returned by `finish`; never panic anyway.
        return Err(syn::Error::new(
            Span::call_site(),
            "#[distributed_lock] cannot expand this function",
        ));
    };

    let timeout = Timeout::tokens(args.timeout.as_ref());
    // The macro's own variables are invisible to the body (mixed-site hygiene); they are
    // located at the return type, where a missing `From<LockError>` is reported.
    let return_span = return_type.span();
    let internal = |name: &str| Ident::new(name, Span::mixed_site().located_at(return_span));
    let key_var = internal("__dlock_key");
    let guard_var = internal("__dlock_guard");
    let output_var = internal("__dlock_output");
    let provider_var = internal("__dlock_provider");
    let error_var = internal("__dlock_error");
    let many = matches!(args.keys, Keys::Many(..));
    let guard_type = if many {
        quote!([::dlock::__private::LockGuard])
    } else {
        quote!(::dlock::__private::LockGuard)
    };
    let user_guard = args.guard.as_ref().map(|(_, name)| {
        quote! {
            let #name: &#guard_type = &#guard_var;
        }
    });
    // A provider of the wrong type is reported at the provider.
    let provider_ref = quote_spanned!(provider.span()=> &(#provider));
    // `on_lost = cancel`: the body races the lost token(s), and the `..._unless_lost`
    // finishing function turns a body stopped by the loss into `Err(Lost)`. One finishing
    // function per mode, for both ends, so an error type without `From<LockError>` is
    // reported once.
    let cancel = matches!(args.on_lost, Some((_, OnLost::Cancel)));
    let finish_fn = match (many, cancel) {
        (false, true) => quote_spanned!(return_span=> ::dlock::__private::finish_unless_lost),
        (false, false) => quote_spanned!(return_span=> ::dlock::__private::finish),
        (true, true) => quote_spanned!(return_span=> ::dlock::__private::finish_many_unless_lost),
        (true, false) => quote_spanned!(return_span=> ::dlock::__private::finish_many),
    };
    let fail = quote_spanned! {return_span=>
        #finish_fn(::core::result::Result::Err(#error_var)).await
    };
    let finish = quote_spanned! {return_span=>
        #finish_fn(::core::result::Result::Ok((#guard_var, #output_var))).await
    };
    let block = &function.block;
    let run_body = match (many, cancel) {
        (false, true) => {
            quote! { ::dlock::__private::until_lost(&#guard_var, async move #block).await }
        }
        (true, true) => {
            quote! { ::dlock::__private::until_any_lost(&#guard_var, async move #block).await }
        }
        (false, false) => {
            quote! {
                ::dlock::__private::checked(
                    &#guard_var,
                    ::dlock::__private::holding(&#guard_var, async move #block),
                )
                .await
            }
        }
        (true, false) => {
            quote! {
                ::dlock::__private::checked_many(
                    &#guard_var,
                    ::dlock::__private::run_holding(&#guard_var, async move #block),
                )
                .await
            }
        }
    };
    let (key_decl, acquire) = match (&args.keys, &args.permits) {
        (Keys::Many(..), _) => {
            let count = keys.len();
            (
                quote!(let #key_var: [::std::string::String; #count] = [#(#keys),*];),
                quote!(::dlock::__private::acquire_many(#provider_var, &#key_var, #timeout)),
            )
        }
        (Keys::One(_), Some((_, permits))) => (
            quote!(let #key_var: ::std::string::String = #(#keys)*;),
            quote!(::dlock::__private::acquire_semaphore(
                #provider_var, &#key_var, #permits, #timeout
            )),
        ),
        (Keys::One(_), None) if matches!(args.mode, Some((_, Mode::Read))) => (
            quote!(let #key_var: ::std::string::String = #(#keys)*;),
            quote!(#provider_var.acquire_read(&#key_var, #timeout)),
        ),
        (Keys::One(_), None) => (
            quote!(let #key_var: ::std::string::String = #(#keys)*;),
            quote!(#provider_var.acquire(&#key_var, #timeout)),
        ),
    };
    let body = quote! {
        {
            #key_decl
            let #guard_var = {
                let #provider_var: &::dlock::__private::LockProvider = #provider_ref;
                match #acquire.await {
                    ::core::result::Result::Ok(guard) => guard,
                    ::core::result::Result::Err(#error_var) => return #fail,
                }
            };
            let #output_var = {
                #user_guard
                #run_body
            };
            #finish
        }
    };
    function.block = syn::parse2(body)?;
    Ok(function.into_token_stream())
}
