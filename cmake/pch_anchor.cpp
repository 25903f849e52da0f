// Anchor translation unit for the project's shared precompiled header (cmake/shampoo_pch.h).
